"""Direction: genuine NeMo Gym agents -> gymbridge's resources servers.

Genuine ``simple_agent`` drives each of our tool environments (counter through its tools and
session cookie, circle_click, beep_count, bouncing_ball, zoom_read) to reward 1.0 with the scripted
model replaying an oracle solution; genuine ``gymnasium_agent`` drives our ``grid_door`` through
``/reset`` + ``/step``. Also the recorded error behaviour: wrong argument types, non-JSON
arguments, an unknown tool and a raising tool all reach the model as an error body and the rollout
completes, and our server answers 4xx (never 5xx) to bad input.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _genuine import KIND_AGENTS, KIND_MODELS, KIND_RESOURCES, GenuineStack
from _gym_support import MODEL_NAME, ScriptBook, ThreadedLoop, add_scripted_model
from _oracles import GYMNASIUM_ORACLES, TOOL_ORACLES

import gymbridge.client as client_mod
import gymbridge.server as server_sdk
import gymbridge.trajectory as trajectory_mod

pytestmark = pytest.mark.gym


ENV_CLASSES = {
    "counter": "CounterServer",
    "circle_click": "CircleClickServer",
    "beep_count": "BeepCountServer",
    "bouncing_ball": "BouncingBallServer",
    "zoom_read": "ZoomReadServer",
    "grid_door": "GridDoorServer",
}
ROWS_PER_ENV = 2


class FaultyServer(server_sdk.ResourcesServer):  # type: ignore[misc, name-defined]
    """A tiny environment of ours with a typed tool and a tool that raises."""

    @server_sdk.tool  # type: ignore[untyped-decorator]
    async def add(self, session: Any, a: int, b: int) -> dict[str, int]:
        """Add a and b; remember the sum."""
        session.state["sum"] = a + b
        return {"sum": a + b}

    @server_sdk.tool  # type: ignore[untyped-decorator]
    async def explode(self) -> dict[str, Any]:
        """Always raises."""
        raise RuntimeError("kaboom from a raising tool")

    async def verify(self, session: Any, row: dict[str, Any], response: dict[str, Any]) -> Any:
        reward = 1.0 if session.state.get("sum") == row["expected_sum"] else 0.0
        if row.get("simulate_infra_failure"):
            return server_sdk.VerifyResult(
                reward=reward,
                mask_sample=True,
                failure_kind="faulty:judge_unavailable",
                failure_reason="simulated: the judge did not answer",
            )
        return server_sdk.VerifyResult(reward=reward)


def _env_server(name: str) -> Any:
    module = importlib.import_module(f"gymbridge_envs.{name}.server")
    return getattr(module, ENV_CLASSES[name])(instance_name=f"ours_{name}")


def _rows(name: str, n: int) -> list[dict[str, Any]]:
    data = importlib.import_module(f"gymbridge_envs.{name}.data")
    return list(data.generate(n, seed=11))


@pytest.fixture(scope="module")
def ours_behind_genuine(
    fixture_loop: ThreadedLoop, scripted_model_url: str, gym_log_root: Path
) -> Iterator[tuple[GenuineStack, dict[str, str]]]:
    """Our environments in-process, each behind a genuine agent (one stack, started in parallel)."""
    running: list[Any] = []
    urls: dict[str, str] = {}
    stack = GenuineStack(gym_log_root / "genuine_agents_ours")
    add_scripted_model(stack, scripted_model_url)
    servers = {name: _env_server(name) for name in ENV_CLASSES}
    servers["faulty"] = FaultyServer(instance_name="ours_faulty")
    for name, server in servers.items():
        rs = fixture_loop.run(server_sdk.start_server(server))
        running.append(rs)
        urls[name] = rs.url
        stack.add(f"ours_{name}", KIND_RESOURCES, name, port=rs.port, launch=False)
        gymnasium = name in GYMNASIUM_ORACLES
        stack.add(
            f"agent_{name}",
            KIND_AGENTS,
            "gymnasium_agent" if gymnasium else "simple_agent",
            resources_server={"type": KIND_RESOURCES, "name": f"ours_{name}"},
            model_server={"type": KIND_MODELS, "name": MODEL_NAME},
            max_steps=32 if gymnasium else 10,
        )
    try:
        stack.start()
        yield stack, urls
    finally:
        stack.stop()
        for rs in running:
            fixture_loop.run(rs.stop())


def _scripted_row(row: dict[str, Any], script_name: str) -> dict[str, Any]:
    row = copy.deepcopy(row)
    rcp = row["responses_create_params"]
    rcp["metadata"] = {**(rcp.get("metadata") or {}), "script": script_name}
    return row


def _run_all(stack: GenuineStack, agent: str, rows: list[dict[str, Any]]) -> list[httpx.Response]:
    def one(row: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{stack.url(agent)}/run", json=row, timeout=60, trust_env=False)

    with cf.ThreadPoolExecutor(len(rows)) as pool:
        return list(pool.map(one, rows))


@pytest.mark.parametrize("env", sorted(TOOL_ORACLES))
def test_genuine_simple_agent_solves_our_tool_env(
    env: str, ours_behind_genuine: tuple[GenuineStack, dict[str, str]], script_book: ScriptBook
) -> None:
    stack, _ = ours_behind_genuine
    rows = []
    for i, row in enumerate(_rows(env, ROWS_PER_ENV)):
        name = script_book.add(f"oracle-{env}-{i}", TOOL_ORACLES[env](row))
        rows.append(_scripted_row(row, name))
    results = _run_all(stack, f"agent_{env}", rows)
    assert [r.status_code for r in results] == [200] * len(rows), [r.text[:500] for r in results]
    for r in results:
        result = r.json()
        assert result["reward"] == 1.0, {k: v for k, v in result.items() if k != "responses_create_params"}
        calls = [i for i in result["response"]["output"] if i["type"] == "function_call"]
        outs = [i for i in result["response"]["output"] if i["type"] == "function_call_output"]
        assert len(calls) == len(outs) >= 1
        assert [o["call_id"] for o in outs] == [c["call_id"] for c in calls]
        assert result["response"]["output"][-1]["type"] == "message"


def test_genuine_simple_agent_counter_session_is_per_rollout(
    ours_behind_genuine: tuple[GenuineStack, dict[str, str]], script_book: ScriptBook
) -> None:
    """Our counter keeps state in the session cookie the genuine agent forwards by hand."""
    stack, _ = ours_behind_genuine
    rows = []
    for i, row in enumerate(_rows("counter", 6)):
        name = script_book.add(f"counter-session-{i}", TOOL_ORACLES["counter"](row))
        rows.append(_scripted_row(row, name))
    results = _run_all(stack, "agent_counter", rows)
    got = [r.json() for r in results]
    assert [g["reward"] for g in got] == [1.0] * len(rows)
    reads = [
        [o["output"] for o in g["response"]["output"] if o["type"] == "function_call_output"][-1] for g in got
    ]
    expected = [row["expected_count"] for row in _rows("counter", 6)]
    assert [json.loads(read)["count"] for read in reads] == expected
    assert len(set(expected)) > 1  # distinct answers: a shared counter could not satisfy all of them


@pytest.mark.parametrize("env", sorted(GYMNASIUM_ORACLES))
def test_genuine_gymnasium_agent_solves_our_env(
    env: str, ours_behind_genuine: tuple[GenuineStack, dict[str, str]], script_book: ScriptBook
) -> None:
    stack, _ = ours_behind_genuine
    rows = []
    for i, row in enumerate(_rows(env, ROWS_PER_ENV)):
        name = script_book.add(f"gym-oracle-{env}-{i}", GYMNASIUM_ORACLES[env](row))
        rows.append(_scripted_row(row, name))
    results = _run_all(stack, f"agent_{env}", rows)
    assert [r.status_code for r in results] == [200] * len(rows), [r.text[:500] for r in results]
    for row, r in zip(rows, results, strict=True):
        result = r.json()
        assert result["reward"] == 1.0 and result["terminated"] is True, result.get("info")
        messages = [i for i in result["response"]["output"] if i["type"] == "message"]
        assistant = [m for m in messages if m.get("role") == "assistant"]
        assert len(assistant) == len(GYMNASIUM_ORACLES[env](row))


def test_wrong_oracle_scores_zero(
    ours_behind_genuine: tuple[GenuineStack, dict[str, str]], script_book: ScriptBook
) -> None:
    """The rewards above are earned: a wrong answer through the same path scores 0."""
    stack, _ = ours_behind_genuine
    row = _rows("circle_click", 1)[0]
    other = next(c for c in row["circles"] if c["color"] != row["target_color"])
    name = script_book.add("wrong-click", [{"calls": [{"name": "click", "arguments": other}]}, "done"])
    (r,) = _run_all(stack, "agent_circle_click", [_scripted_row(row, name)])
    assert r.status_code == 200 and r.json()["reward"] == 0.0


def test_tool_errors_reach_the_model_and_rollout_completes(
    ours_behind_genuine: tuple[GenuineStack, dict[str, str]], script_book: ScriptBook, scripted_model: Any
) -> None:
    stack, _ = ours_behind_genuine
    script = [
        {"calls": [{"name": "add", "arguments": {"a": "two", "b": [3]}}]},  # wrong argument types
        {"calls": [{"name": "add", "arguments": "{'a': 2, b: 3"}]},  # non-JSON arguments
        {"calls": [{"name": "subtract", "arguments": {"a": 2, "b": 3}}]},  # unknown tool
        {"calls": [{"name": "explode", "arguments": {}}]},  # a raising tool
        {"calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
        "The sum is 5.",
    ]
    name = script_book.add("faulty", script)
    row = {
        "responses_create_params": {
            "input": [{"role": "user", "content": "add 2 and 3"}],
            "tools": [t for t in FaultyServer(instance_name="x").function_tools()],
        },
        "expected_sum": 5,
    }
    (r,) = _run_all(stack, "agent_faulty", [_scripted_row(row, name)])
    assert r.status_code == 200, r.text[:1000]
    result = r.json()
    assert result["reward"] == 1.0
    outs = [i["output"] for i in result["response"]["output"] if i["type"] == "function_call_output"]
    assert len(outs) == 5
    wrong_types, non_json, unknown, raising, ok = outs
    # our server's 422 names both bad arguments (FastAPI's shape, as genuine servers answer)
    assert [d["loc"] for d in json.loads(wrong_types)["detail"]] == [["body", "a"], ["body", "b"]]
    # the genuine agent answers non-JSON arguments itself, without calling our server
    assert non_json.startswith('{"error": "Invalid tool call arguments')
    assert json.loads(unknown) == {"detail": "Not Found"}  # genuine servers' 404 body
    assert json.loads(raising) == "RuntimeError('kaboom from a raising tool')"  # stock Gym's 500 body
    assert json.loads(ok) == {"sum": 5}
    # the model saw each error body verbatim: the last model call's input replays all of them
    calls = [b for b in scripted_model.requests if (b.get("metadata") or {}).get("script") == name]
    assert len(calls) == len(script)
    seen = [i["output"] for i in calls[-1]["input"] if i.get("type") == "function_call_output"]
    assert seen == outs


@pytest.mark.parametrize(
    ("path", "body", "content_type"),
    [
        ("/add", b'{"a": "two", "b": 3}', "application/json"),  # wrong type
        ("/add", b"{not json", "application/json"),  # non-JSON body
        ("/add", b"[1, 2]", "application/json"),  # not an object
        ("/add", b'{"a": 1}', "application/json"),  # missing argument
        ("/subtract", b'{"a": 1, "b": 2}', "application/json"),  # unknown tool
        ("/verify", b'{"responses_create_params": 5}', "application/json"),  # malformed verify
        ("/seed_session", b"\xff\xfe", "application/json"),  # undecodable bytes
    ],
)
def test_our_server_answers_4xx_to_bad_input(
    path: str, body: bytes, content_type: str, ours_behind_genuine: tuple[GenuineStack, dict[str, str]]
) -> None:
    _, urls = ours_behind_genuine
    r = httpx.post(
        urls["faulty"] + path,
        content=body,
        headers={"content-type": content_type},
        trust_env=False,
        timeout=30,  # httpx's default 5 s is tight on 2 cores shared by 8 jobs
    )
    assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:300])
    assert r.text  # an error body the model (or the caller) can read


async def test_0_7_0_verify_fields_reach_trajectory(
    ours_behind_genuine: tuple[GenuineStack, dict[str, str]], script_book: ScriptBook
) -> None:
    """Our server's mask_sample / failure_kind / failure_reason survive the genuine agent into Trajectory."""
    stack, _ = ours_behind_genuine
    name = script_book.add("faulty-mask", [{"calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]}, "2"])
    row = {
        "responses_create_params": {
            "input": [{"role": "user", "content": "add 1 and 1"}],
            "tools": FaultyServer(instance_name="x").function_tools(),
        },
        "expected_sum": 2,
    }
    masked = {**_scripted_row(row, name), "simulate_infra_failure": True}
    plain = _scripted_row(row, name)
    async with client_mod.GymClient(agent_url=stack.url("agent_faulty"), deadline_s=60) as client:
        outcomes = sorted(
            [o async for o in client.run_many([masked, plain], concurrency=2, progress=False)],
            key=lambda o: o.index,
        )
    assert all(o.ok for o in outcomes), [o.reason for o in outcomes]
    assert outcomes[0].result["failure_kind"] == "faulty:judge_unavailable"
    t_masked, t_plain = (trajectory_mod.from_gym_result(o.result) for o in outcomes)
    assert (t_masked.mask_sample, t_masked.failure_class, t_masked.failure_reason) == (
        True,
        "faulty:judge_unavailable",
        "simulated: the judge did not answer",
    )
    assert (t_plain.mask_sample, t_plain.failure_class, t_plain.failure_reason) == (False, None, None)
    assert t_masked.reward == t_plain.reward == 1.0
