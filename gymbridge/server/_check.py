"""check_env: a conformance pass an environment author runs in their tests.

``await check_env(url, rows)`` talks to a running resources server over HTTP
and checks, for every row, within one session (one cookie):

* health: ``GET /`` answers ``{"status": "ok"}``; a ``/ng-rollout/<id>/`` prefix
  reaches the same route;
* published tools (``GET /tools``): each is a Responses function tool whose
  ``parameters`` is a valid JSON schema (Draft 2020-12 when ``jsonschema`` is
  installed), strict-mode valid when it says ``strict: true``, and every
  tool a row offers in ``responses_create_params.tools`` is served with the
  same schema;
* tool style: ``seed_session`` -> each tool once (except ``skip_tools``) (arguments from ``tool_args`` or
  synthesised from its schema; no 5xx) -> bad arguments answer 4xx, not 5xx ->
  malformed JSON answers 4xx -> ``verify`` answers the row echoed with a finite
  float ``reward`` (and ``reward_components`` summing to it);
* gymnasium style: ``reset`` -> ``step`` until terminated/truncated (at most
  ``max_steps``), every answer in the stock shape, rewards finite;
* determinism: seeding (or resetting) the same row in two fresh sessions gives
  the same answer; ``generate(seed)`` (when given) gives equal rows twice.

Every problem is collected (not just the first); :class:`CheckEnvError` lists
them all. The report is returned when nothing failed.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import jsonschema

from gymbridge.errors import CheckEnvError, EnvError, ProtocolError
from gymbridge.server._http import Reply, get, make_client_session, post_json
from gymbridge.server._tools import strict_schema_ok

__all__ = ["CheckEnvError", "CheckReport", "check_env", "example_arguments"]


@dataclass
class CheckReport:
    """What ``check_env`` verified: one line per passed check, the problems found."""

    url: str
    passed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def example_arguments(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A minimal argument object that satisfies ``schema`` (required properties only)."""
    value = _example(schema, schema.get("$defs", {}))
    return value if isinstance(value, dict) else {}


def _example(schema: Any, defs: Mapping[str, Any]) -> Any:
    if not isinstance(schema, Mapping):
        return None
    if "$ref" in schema:
        return _example(defs.get(str(schema["$ref"]).rsplit("/", 1)[-1], {}), defs)
    if "default" in schema:
        return schema["default"]
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return _example(schema[key][0], defs)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        return {name: _example(props.get(name, {}), defs) for name in schema.get("required", [])}
    if kind == "array":
        n = int(schema.get("minItems", 0))
        return [_example(schema.get("items", {}), defs) for _ in range(n)]
    if kind == "integer":
        return int(schema.get("minimum", schema.get("exclusiveMinimum", -1) + 1))
    if kind == "number":
        return float(schema.get("minimum", 0.0))
    if kind == "boolean":
        return False
    if kind == "string":
        return "a" * int(schema.get("minLength", 0))
    return None


def _bad_arguments(schema: Mapping[str, Any]) -> dict[str, Any] | None:
    """Arguments with a wrong-typed required property (None when nothing can be wrong)."""
    props = schema.get("properties", {})
    for name in schema.get("required", []):
        kind = props.get(name, {}).get("type")
        if kind in ("integer", "number", "boolean", "array", "object"):
            return {**example_arguments(schema), name: "not-a-" + str(kind)}
    return None


def _schema_problems(tool: Any) -> list[str]:
    if not isinstance(tool, dict):
        return [f"published tool is not an object: {tool!r}"]
    name = tool.get("name")
    problems = []
    if tool.get("type") != "function":
        problems.append(f"tool {name!r}: type must be 'function', got {tool.get('type')!r}")
    if not isinstance(name, str) or not name:
        problems.append(f"tool {tool!r}: missing name")
    params = tool.get("parameters")
    if not isinstance(params, dict) or params.get("type") != "object":
        problems.append(f"tool {name!r}: parameters must be a JSON schema of type 'object'")
        return problems
    strict = tool.get("strict", False)
    if not isinstance(strict, bool):
        problems.append(f"tool {name!r}: strict must be a bool, got {strict!r}")
    elif strict and not strict_schema_ok(params):
        problems.append(
            f"tool {name!r}: strict is true but the schema is not strict-mode valid "
            "(every object needs additionalProperties: false and all its properties required)"
        )
    try:
        jsonschema.Draft202012Validator.check_schema(params)
        jsonschema.validate(example_arguments(params), params)
    except jsonschema.exceptions.SchemaError as exc:
        problems.append(f"tool {name!r}: invalid JSON schema: {exc.message}")
    except jsonschema.exceptions.ValidationError as exc:
        problems.append(
            f"tool {name!r}: synthesised arguments do not validate ({exc.message}); pass tool_args"
        )
    return problems


def _synthetic_response(calls: list[tuple[str, dict[str, Any]]], text: str) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    for name, args in calls:
        call_id = f"call_{uuid.uuid4().hex[:12]}"
        output.append(
            {
                "type": "function_call",
                "call_id": call_id,
                "name": name,
                "arguments": json.dumps(args),
                "id": call_id,
            }
        )
        output.append({"type": "function_call_output", "call_id": call_id, "output": "{}"})
    output.append(
        {
            "type": "message",
            "role": "assistant",
            "id": f"msg_{uuid.uuid4().hex[:12]}",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    )
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": 0.0,
        "model": "check_env",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


class _Checker:
    def __init__(
        self, url: str, client: aiohttp.ClientSession, report: CheckReport, timeout_s: float
    ) -> None:
        self.url = url.rstrip("/")
        self.client = client
        self.report = report
        self.timeout_s = timeout_s

    def ok(self, what: str) -> None:
        self.report.passed.append(what)

    def fail(self, what: str) -> None:
        self.report.problems.append(what)

    async def post(self, path: str, body: Any, cookies: dict[str, str]) -> Reply:
        reply = await post_json(self.client, self.url + path, body, timeout_s=self.timeout_s, cookies=cookies)
        cookies.update(reply.cookies)
        return reply

    def expect_json_object(self, reply: Reply, what: str) -> dict[str, Any] | None:
        if not reply.ok:
            self.fail(f"{what}: HTTP {reply.status}: {reply.text[:300]}")
            return None
        try:
            data = reply.json()
        except ProtocolError as exc:
            self.fail(f"{what}: {exc}")
            return None
        if not isinstance(data, dict):
            self.fail(f"{what}: expected a JSON object, got {type(data).__name__}")
            return None
        return data


async def check_env(
    url: str,
    rows: Sequence[dict[str, Any]],
    *,
    tool_args: Mapping[str, dict[str, Any]] | None = None,
    skip_tools: Sequence[str] = (),
    answer_text: str = "",
    generate: Callable[[int], Sequence[dict[str, Any]]] | None = None,
    gymnasium: bool | None = None,
    max_steps: int = 8,
    timeout_s: float = 30.0,
    raise_on_failure: bool = True,
) -> CheckReport:
    """Run the conformance pass against the server at ``url`` (see the module docstring)."""
    report = CheckReport(url=url)
    if not rows:
        report.problems.append("no rows given: check_env needs at least one dataset row")
    async with make_client_session(64) as client:
        chk = _Checker(url, client, report, timeout_s)
        try:
            await _check_all(
                chk, list(rows), dict(tool_args or {}), set(skip_tools), answer_text, gymnasium, max_steps
            )
        except EnvError as exc:
            chk.fail(f"server unreachable or too slow: {exc}")
    if generate is not None:
        first, second = list(generate(0)), list(generate(0))
        if first != second:
            report.problems.append("generate(seed=0) is not deterministic: two calls gave different rows")
        elif list(generate(1)) == first and first:
            report.problems.append("generate ignores its seed: seeds 0 and 1 gave identical rows")
        else:
            report.passed.append("data generator is deterministic per seed")
    if report.problems and raise_on_failure:
        raise CheckEnvError(report.problems, server=url)
    return report


async def _check_all(
    chk: _Checker,
    rows: list[dict[str, Any]],
    tool_args: dict[str, dict[str, Any]],
    skip_tools: set[str],
    answer_text: str,
    gymnasium: bool | None,
    max_steps: int,
) -> None:
    health = await get(chk.client, chk.url + "/", timeout_s=chk.timeout_s)
    if health.status != 200 or _safe_json(health) != {"status": "ok"}:
        chk.fail(f"GET / must answer 200 {{'status': 'ok'}}, got {health.status} {health.text[:100]!r}")
        return
    chk.ok("GET / is healthy")
    prefixed = await get(chk.client, chk.url + "/ng-rollout/check-env-0/", timeout_s=chk.timeout_s)
    if prefixed.status != 200:
        chk.fail(f"/ng-rollout/<id>/ prefix is not stripped (GET answered {prefixed.status})")
    else:
        chk.ok("/ng-rollout/<id>/ prefix stripped")

    tools_reply = await get(chk.client, chk.url + "/tools", timeout_s=chk.timeout_s)
    published: dict[str, dict[str, Any]] = {}
    if tools_reply.status == 200 and isinstance(_safe_json(tools_reply), list):
        for tool in _safe_json(tools_reply):
            problems = _schema_problems(tool)
            for p in problems:
                chk.fail(p)
            if not problems:
                published[tool["name"]] = tool
        chk.ok(f"{len(published)} published tool schema(s) valid")
    else:
        chk.fail(f"GET /tools must answer a JSON list of function tools, got {tools_reply.status}")

    malformed = await post_json(chk.client, chk.url + "/seed_session", b"{not json", timeout_s=chk.timeout_s)
    if 400 <= malformed.status < 500 and isinstance(_safe_json(malformed), (dict, str)):
        chk.ok("malformed JSON answers 4xx with a JSON error")
    else:
        chk.fail(f"malformed JSON body must answer 4xx with a JSON error, got {malformed.status}")

    is_gym = gymnasium
    if is_gym is None:
        probe = await post_json(chk.client, chk.url + "/step", {}, timeout_s=chk.timeout_s)
        is_gym = probe.status != 404
    for index, row in enumerate(rows):
        where = f"row {index}"
        offered = (row.get("responses_create_params") or {}).get("tools") or []
        for tool in offered:
            name = tool.get("name") if isinstance(tool, dict) else None
            if name not in published:
                chk.fail(f"{where}: offers tool {name!r} that the server does not publish")
            elif tool.get("parameters") != published[name].get("parameters"):
                chk.fail(f"{where}: tool {name!r} schema differs from the server's published schema")
        if is_gym:
            await _check_gymnasium_row(chk, row, where, answer_text, max_steps)
        else:
            tools = {k: v for k, v in published.items() if k not in skip_tools}
            await _check_tool_row(chk, row, where, tools, tool_args, answer_text)


async def _check_tool_row(
    chk: _Checker,
    row: dict[str, Any],
    where: str,
    published: dict[str, dict[str, Any]],
    tool_args: dict[str, dict[str, Any]],
    answer_text: str,
) -> None:
    cookies: dict[str, str] = {}
    seeded = chk.expect_json_object(await chk.post("/seed_session", row, cookies), f"{where}: seed_session")
    if seeded is None:
        return
    again = chk.expect_json_object(await chk.post("/seed_session", row, {}), f"{where}: second seed_session")
    if again is not None and again != seeded:
        chk.fail(f"{where}: seed_session is not deterministic: {seeded!r} != {again!r}")
    calls: list[tuple[str, dict[str, Any]]] = []
    for name, tool in published.items():
        args = tool_args.get(name, example_arguments(tool["parameters"]))
        reply = await chk.post(f"/{name}", args, cookies)
        if reply.status >= 500:
            chk.fail(
                f"{where}: tool {name} with valid arguments {args!r} "
                f"answered {reply.status}: {reply.text[:300]}"
            )
        calls.append((name, args))
        bad = _bad_arguments(tool["parameters"])
        if bad is not None:
            bad_reply = await chk.post(f"/{name}", bad, cookies)
            if not 400 <= bad_reply.status < 500:
                chk.fail(f"{where}: tool {name} with bad arguments must answer 4xx, got {bad_reply.status}")
    unknown = await chk.post("/no_such_tool_check_env", {}, cookies)
    if unknown.status != 404:
        chk.fail(f"{where}: an unknown tool must answer 404, got {unknown.status}")
    verify_body = {**row, "response": _synthetic_response(calls, answer_text)}
    result = chk.expect_json_object(await chk.post("/verify", verify_body, cookies), f"{where}: verify")
    if result is None:
        return
    _check_verify(chk, row, result, where)


def _check_verify(chk: _Checker, row: dict[str, Any], result: dict[str, Any], where: str) -> None:
    reward = result.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        chk.fail(f"{where}: verify reward must be a finite number, got {reward!r}")
        return
    chk.report.rewards.append(float(reward))
    missing = [k for k in row if k not in result]
    if missing:
        chk.fail(f"{where}: verify must echo the row; missing keys {missing}")
    components = result.get("reward_components")
    sums = isinstance(components, dict) and math.isclose(
        math.fsum(float(v) for v in components.values()), float(reward), abs_tol=1e-6
    )
    if components is not None and not sums:
        chk.fail(f"{where}: reward_components {components!r} do not sum to reward {reward}")
    chk.ok(f"{where}: seed -> tools -> verify (reward {reward})")


async def _check_gymnasium_row(
    chk: _Checker, row: dict[str, Any], where: str, answer_text: str, max_steps: int
) -> None:
    cookies: dict[str, str] = {}
    first = chk.expect_json_object(await chk.post("/reset", row, cookies), f"{where}: reset")
    if first is None:
        return
    again = chk.expect_json_object(await chk.post("/reset", row, {}), f"{where}: second reset")
    if again is not None and _strip_info(again) != _strip_info(first):
        chk.fail(f"{where}: reset is not deterministic for the same row")
    _check_observation(chk, first, f"{where}: reset")
    for step in range(max_steps):
        body = {**row, "response": _synthetic_response([], answer_text)}
        data = chk.expect_json_object(await chk.post("/step", body, cookies), f"{where}: step {step}")
        if data is None:
            return
        _check_observation(chk, data, f"{where}: step {step}")
        reward = data.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            chk.fail(f"{where}: step {step} reward must be a finite number, got {reward!r}")
            return
        for key in ("terminated", "truncated"):
            if not isinstance(data.get(key), bool):
                chk.fail(f"{where}: step {step}: {key!r} must be a bool")
                return
        if data["terminated"] or data["truncated"]:
            break
    chk.ok(f"{where}: reset -> step ... in the stock shape")


def _check_observation(chk: _Checker, data: dict[str, Any], where: str) -> None:
    obs = data.get("observation")
    if obs is not None and not isinstance(obs, str):
        chk.fail(f"{where}: observation must be a string or null (stock Gym), got {type(obs).__name__}")
    content = data.get("observation_content")
    if content is not None and not (
        isinstance(content, list)
        and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content)
    ):
        chk.fail(f"{where}: observation_content must be a list of typed content parts")
    if not isinstance(data.get("info", {}), dict):
        chk.fail(f"{where}: info must be an object")


def _strip_info(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k != "info"}


def _safe_json(reply: Reply) -> Any:
    try:
        return reply.json()
    except ProtocolError:
        return None
