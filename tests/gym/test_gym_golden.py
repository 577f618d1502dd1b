"""Genuine simple_agent + genuine resources servers, driven by plain ``/run`` requests.

Role: pin down what genuine NeMo Gym 0.7.0 answers (``tests/gym/recorded/*.json``) with gymbridge's
scripted model as the policy, and assert the behaviour gymbridge relies on: rewards, the order of
output items, token fields on the last item of each model call, session cookies, error bodies
reaching the model with HTTP 200, ``status: "incomplete"`` on reasoning-only output, a model 500
becoming an agent 500 with a JSON-string body, and 422 for extra keys in
``responses_create_params``. Record again with ``GYMBRIDGE_RECORD_GOLDEN=1``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from _genuine import NEMO_GYM_VERSION, GenuineStack
from _golden import check_or_record
from _gym_support import ScriptBook

import gymbridge.server as server_sdk
import gymbridge_envs.counter.server as counter_server

pytestmark = pytest.mark.gym

GENUINE_DATA = Path(__file__).parent / "recorded" / "rows"


def counter_row(initial: int, expected: int, prompt: str) -> dict[str, Any]:
    """A row in the shape of genuine example_session_state_mgmt/data/example.jsonl."""
    tool = {"type": "integer", "description": ""}
    return {
        "responses_create_params": {
            "input": [{"content": prompt, "role": "user"}],
            "tools": [
                {
                    "name": "increment_counter",
                    "parameters": {
                        "type": "object",
                        "properties": {"count": tool},
                        "required": ["count"],
                        "additionalProperties": False,
                    },
                    "strict": True,
                    "type": "function",
                    "description": "",
                },
                {
                    "name": "get_counter_value",
                    "parameters": {
                        "type": "object",
                        "properties": {},
                        "required": [],
                        "additionalProperties": False,
                    },
                    "strict": True,
                    "type": "function",
                    "description": "",
                },
            ],
        },
        "expected_count": expected,
        "initial_count": initial,
    }


def circle_click_row() -> dict[str, Any]:
    """Row 0 of genuine circle_click/data/example.jsonl (copied into recorded/rows by the recorder)."""
    row: dict[str, Any] = json.loads((GENUINE_DATA / "circle_click_example_row0.json").read_text())
    return row


def with_script(row: dict[str, Any], name: str) -> dict[str, Any]:
    row = copy.deepcopy(row)
    row["responses_create_params"]["metadata"] = {"script": name}
    return row


def run(
    stack: GenuineStack,
    agent: str,
    row: dict[str, Any],
    *,
    timeout_s: float = 60.0,
) -> httpx.Response:
    return httpx.post(f"{stack.url(agent)}/run", json=row, timeout=timeout_s, trust_env=False)


def record_run(
    scenario: str,
    description: str,
    stack: GenuineStack,
    agent: str,
    servers: list[str],
    script_book: ScriptBook,
    script: list[Any],
    row: dict[str, Any],
) -> tuple[httpx.Response, dict[str, Any]]:
    script_book.add(scenario, script)
    request = with_script(row, scenario)
    resp = run(stack, agent, request)
    body = resp.json()
    golden = check_or_record(
        scenario,
        {
            "scenario": scenario,
            "description": description,
            "nemo_gym_version": NEMO_GYM_VERSION,
            "servers": servers,
            "script": script,
            "request": request,
            "status": resp.status_code,
            "set_cookie_names": sorted({c.split("=", 1)[0] for c in resp.headers.get_list("set-cookie")}),
            "response": body,
        },
    )
    return resp, golden


def output_types(result: dict[str, Any]) -> list[str]:
    return [item["type"] for item in result["response"]["output"]]


def token_carriers(result: dict[str, Any]) -> list[int]:
    return [i for i, item in enumerate(result["response"]["output"]) if item.get("generation_token_ids")]


COUNTER_SERVERS = ["responses_api_agents/simple_agent", "resources_servers/example_session_state_mgmt"]


def test_counter_run_reward_and_shape(genuine_stack: GenuineStack, script_book: ScriptBook) -> None:
    script = [
        {"calls": [{"name": "increment_counter", "arguments": {"count": 1}}]},
        {"calls": [{"name": "increment_counter", "arguments": {"count": 2}}]},
        {"calls": [{"name": "get_counter_value", "arguments": {}}]},
        "The count is 6.",
    ]
    resp, _ = record_run(
        "simple_agent__example_session_state_mgmt__run",
        "genuine simple_agent drives genuine example_session_state_mgmt: seed 3, +1, +2, read, answer",
        genuine_stack,
        "counter_agent",
        COUNTER_SERVERS,
        script_book,
        script,
        counter_row(3, 6, "add 1 then add 2 then get the count"),
    )
    assert resp.status_code == 200
    result = resp.json()
    assert result["reward"] == 1.0
    assert output_types(result) == ["function_call", "function_call_output"] * 3 + ["message"]
    # token fields on the last item of every model call: the 3 calls and the final message
    assert token_carriers(result) == [0, 2, 4, 6]
    outputs = [i["output"] for i in result["response"]["output"] if i["type"] == "function_call_output"]
    assert outputs == ['{"success":true}', '{"success":true}', '{"count":6}']
    # 0.7.0 top-level verify fields; genuine counter's verify model declares no row keys, so
    # expected_count / initial_count are NOT echoed (consumers must not rely on a full echo)
    assert set(result) == {
        "responses_create_params",
        "response",
        "reward",
        "mask_sample",
        "failure_kind",
        "failure_reason",
    }
    assert (result["mask_sample"], result["failure_kind"], result["failure_reason"]) == (False, None, None)


def test_counter_sessions_are_isolated(genuine_stack: GenuineStack, script_book: ScriptBook) -> None:
    """Concurrent rollouts each get their own counter (the session cookie is per rollout)."""
    script_book.add(
        "isolation",
        lambda body: [
            {"calls": [{"name": "increment_counter", "arguments": {"count": 5}}]},
            "done",
        ][min(_calls(body), 1)],
    )
    rows = [with_script(counter_row(i, i + 5, f"add 5 to {i}"), "isolation") for i in range(6)]

    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda r: run(genuine_stack, "counter_agent", r), rows))
    assert [r.status_code for r in results] == [200] * 6
    assert [r.json()["reward"] for r in results] == [1.0] * 6


def _calls(body: dict[str, Any]) -> int:
    from gymbridge.testing.scripted_model import call_index

    return call_index(body)


def test_circle_click_run_image_and_reward(genuine_stack: GenuineStack, script_book: ScriptBook) -> None:
    row = circle_click_row()
    target = next(c for c in row["circles"] if c["color"] == row["target_color"])
    resp, _ = record_run(
        "simple_agent__circle_click__run",
        "genuine simple_agent (max_steps=1) drives genuine circle_click: one click on the target circle",
        genuine_stack,
        "circle_click_agent",
        ["responses_api_agents/simple_agent", "resources_servers/circle_click"],
        script_book,
        [{"calls": [{"name": "click", "arguments": {"x": target["x"], "y": target["y"]}}]}],
        row,
    )
    assert resp.status_code == 200
    result = resp.json()
    assert result["reward"] == 1.0 and result["hit"] is True
    assert (result["clicked_x"], result["clicked_y"]) == (target["x"], target["y"])
    assert output_types(result) == ["function_call", "function_call_output"]
    # the image stays in the echoed request input (turn 0's media)
    parts = result["responses_create_params"]["input"][1]["content"]
    assert parts[0]["type"] == "input_image" and parts[0]["image_url"].startswith("data:image/png;base64,")


def test_circle_click_miss_scores_zero(genuine_stack: GenuineStack, script_book: ScriptBook) -> None:
    script_book.add("miss", [{"calls": [{"name": "click", "arguments": {"x": 0, "y": 0}}]}])
    resp = run(genuine_stack, "circle_click_agent", with_script(circle_click_row(), "miss"))
    assert resp.status_code == 200
    assert resp.json()["reward"] == 0.0 and resp.json()["hit"] is False


def test_tool_errors_reach_the_model(genuine_stack: GenuineStack, script_book: ScriptBook) -> None:
    """Wrong types, non-JSON arguments, an unknown tool: each an error body, and the rollout completes."""
    script = [
        {"calls": [{"name": "increment_counter", "arguments": {"count": "three"}}]},
        {"calls": [{"name": "increment_counter", "arguments": "{not json"}]},
        {"calls": [{"name": "no_such_tool", "arguments": {}}]},
        {"calls": [{"name": "get_counter_value", "arguments": {}}]},
        "The count is 3.",
    ]
    resp, _ = record_run(
        "simple_agent__example_session_state_mgmt__tool_errors",
        "genuine simple_agent + genuine counter: wrong argument type (FastAPI 422 body), non-JSON "
        "arguments (agent-made error), unknown tool (404 body); all go back to the model as text",
        genuine_stack,
        "counter_agent",
        COUNTER_SERVERS,
        script_book,
        script,
        counter_row(3, 3, "try things"),
    )
    assert resp.status_code == 200
    result = resp.json()
    assert result["reward"] == 1.0
    outs = [i["output"] for i in result["response"]["output"] if i["type"] == "function_call_output"]
    assert len(outs) == 4
    assert "int_parsing" in outs[0] or "integer" in outs[0]
    assert outs[1].startswith('{"error": "Invalid tool call arguments')
    assert "Not Found" in outs[2]
    assert outs[3] == '{"count":3}'


def test_reasoning_only_output_is_incomplete(genuine_stack: GenuineStack, script_book: ScriptBook) -> None:
    resp, _ = record_run(
        "simple_agent__example_session_state_mgmt__reasoning_only",
        "genuine simple_agent stops with status incomplete on reasoning-only model output",
        genuine_stack,
        "counter_agent",
        COUNTER_SERVERS,
        script_book,
        [{"reasoning": "I am thinking but never answer."}],
        counter_row(1, 2, "add one"),
    )
    assert resp.status_code == 200
    result = resp.json()
    assert result["response"]["status"] == "incomplete"
    assert result["response"]["metadata"]["ng_termination_reason"] == "incomplete_reasoning"
    assert output_types(result) == ["reasoning"]
    assert result["reward"] == 0.0


def test_model_500_becomes_agent_500_json_string(
    genuine_stack: GenuineStack, script_book: ScriptBook
) -> None:
    resp, _ = record_run(
        "simple_agent__example_session_state_mgmt__model_500",
        "a model-server 500 becomes an agent 500 whose body is a JSON string",
        genuine_stack,
        "counter_agent",
        COUNTER_SERVERS,
        script_book,
        [{"status": 500, "body": {"error": "scripted model failure"}}],
        counter_row(1, 2, "add one"),
    )
    assert resp.status_code == 500
    body = resp.json()
    assert isinstance(body, str) and "scripted model failure" in body


def test_extra_key_in_responses_create_params_is_422(
    genuine_stack: GenuineStack, script_book: ScriptBook
) -> None:
    row = counter_row(1, 2, "add one")
    row["responses_create_params"]["gymbridge_request_id"] = "abc"
    resp, _ = record_run(
        "simple_agent__example_session_state_mgmt__extra_key_422",
        "responses_create_params forbids extra keys: a client-added key makes the agent answer 422",
        genuine_stack,
        "counter_agent",
        COUNTER_SERVERS,
        script_book,
        ["unused"],
        row,
    )
    assert resp.status_code == 422
    detail = resp.json()["detail"]
    assert any(d["type"] == "extra_forbidden" and "gymbridge_request_id" in d["loc"] for d in detail)


def test_top_level_extra_keys_pass_through(genuine_stack: GenuineStack, script_book: ScriptBook) -> None:
    """Keys at the row's top level (where gymbridge puts its own) are accepted, never a 422."""
    script_book.add("toplevel", [{"calls": [{"name": "increment_counter", "arguments": {"count": 1}}]}, "ok"])
    row = with_script(counter_row(1, 2, "add one"), "toplevel")
    row.update({"_ng_task_index": 7, "_ng_rollout_index": 2, "gymbridge_request_id": "abc"})
    resp = run(genuine_stack, "counter_agent", row)
    assert resp.status_code == 200
    result = resp.json()
    assert result["reward"] == 1.0
    # genuine counter's verify response model drops undeclared row keys: no echo to rely on
    assert "gymbridge_request_id" not in result


def test_genuine_resources_server_endpoints(genuine_stack: GenuineStack) -> None:
    """Every endpoint of a genuine resources server, answered and recorded (parity data for ours)."""
    base = genuine_stack.url("counter")
    row = counter_row(3, 4, "add 1")
    calls: list[tuple[str, str, Any]] = [
        ("GET", "/", None),
        ("GET", "/livez", None),
        ("GET", "/healthz", None),
        ("GET", "/readyz", None),
        ("POST", "/seed_session", row),
        ("POST", "/increment_counter", {"count": 1}),
        ("POST", "/get_counter_value", {}),
        ("POST", "/ng-rollout/r-1/get_counter_value", {}),
        ("POST", "/increment_counter", {"count": "x"}),
        ("POST", "/no_such_tool", {}),
        ("POST", "/verify", {**row, "response": _minimal_response()}),
        (
            "POST",
            "/aggregate_metrics",
            {"verify_responses": [{**row, "response": _minimal_response(), "reward": 1.0}]},
        ),
        ("POST", "/close_session", {}),
        (
            "POST",
            "/close_session",
            {"resources_session_id": "s-1", "episode_id": {"rollout_id": "r-1", "attempt": 0}},
        ),
        ("POST", "/get_counter_value", {}),
    ]
    exchanges = []
    with httpx.Client(base_url=base, timeout=30, trust_env=False) as client:  # keeps the session cookie
        for method, path, body in calls:
            r = client.request(method, path, json=body) if body is not None else client.request(method, path)
            exchanges.append(
                {
                    "method": method,
                    "path": path,
                    "request": body,
                    "status": r.status_code,
                    "set_cookie_names": sorted(
                        {c.split("=", 1)[0] for c in r.headers.get_list("set-cookie")}
                    ),
                    "response": r.json()
                    if r.headers.get("content-type", "").startswith("application/json")
                    else r.text,
                }
            )
    by_path = {(e["method"], e["path"]): e for e in exchanges}
    assert all(
        by_path[("GET", p)]["response"] == {"status": "ok"} for p in ("/", "/livez", "/healthz", "/readyz")
    )
    assert by_path[("POST", "/seed_session")]["set_cookie_names"] == [
        "StatefulCounterResourcesServer___counter"
    ]
    reads = [e["response"] for e in exchanges if e["path"].endswith("/get_counter_value")]
    # state lives in the cookie session, also for /ng-rollout/<id>/ prefixed paths; genuine
    # /close_session answers but this example keeps its per-session dict (still 4 afterwards)
    assert reads == [{"count": 4}, {"count": 4}, {"count": 4}]
    closes = [e for e in exchanges if e["path"] == "/close_session"]
    assert [e["status"] for e in closes] == [422, 200]  # 0.7.0: resources_session_id + episode_id required
    assert [e["status"] for e in exchanges if e["path"] == "/increment_counter"] == [
        200,
        422,
    ]  # then bad type
    assert by_path[("POST", "/no_such_tool")]["status"] == 404
    assert by_path[("POST", "/verify")]["response"]["reward"] == 1.0
    golden = {
        "scenario": "example_session_state_mgmt__endpoints",
        "description": "direct calls to a genuine resources server (one cookie session), in order",
        "nemo_gym_version": NEMO_GYM_VERSION,
        "servers": ["resources_servers/example_session_state_mgmt"],
        "exchanges": exchanges,
    }
    _check_or_record_exchanges(golden)


def _minimal_response() -> dict[str, Any]:
    return {
        "id": "resp_1",
        "created_at": 0,
        "model": "m",
        "object": "response",
        "output": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


def _check_or_record_exchanges(record: dict[str, Any]) -> None:
    from _golden import RECORD, golden_path, load, mask_tokens, normalise, write

    record = normalise(record)
    name = record["scenario"]
    if RECORD:
        write(name, record)
        return
    assert golden_path(name).exists(), (
        f"no golden file {golden_path(name)}: record it with GYMBRIDGE_RECORD_GOLDEN=1"
    )
    golden = load(name)
    got = [
        (e["path"], e["status"], e["set_cookie_names"], mask_tokens(e["response"]))
        for e in record["exchanges"]
    ]
    want = [
        (e["path"], e["status"], e["set_cookie_names"], mask_tokens(e["response"]))
        for e in golden["exchanges"]
    ]
    assert got == want


def test_our_counter_answers_like_genuine(fixture_loop: Any) -> None:
    """Replay the recorded genuine exchanges against our counter: same statuses, same tool bodies."""
    from _golden import load

    golden = load("example_session_state_mgmt__endpoints")
    running = fixture_loop.run(server_sdk.start_server(counter_server.CounterServer(instance_name="counter")))
    try:
        got = []
        with httpx.Client(base_url=running.url, timeout=30, trust_env=False) as client:
            for e in golden["exchanges"]:
                body = e["request"]
                r = (
                    client.request(e["method"], e["path"], json=body)
                    if body is not None
                    else client.request(e["method"], e["path"])
                )
                got.append((e["path"], r.status_code, r.json()))
    finally:
        fixture_loop.run(running.stop())
    want = [(e["path"], e["status"], e["response"]) for e in golden["exchanges"]]
    # one deliberate difference: ours accepts a bare /close_session ({}) where genuine 0.7.0 answers
    # 422 (it requires resources_session_id + episode_id); both accept the full body
    lenient = [
        i for i, e in enumerate(golden["exchanges"]) if e["path"] == "/close_session" and e["request"] == {}
    ]
    assert [got[i][1] for i in lenient] == [200]
    assert [(p, s) for i, (p, s, _) in enumerate(got) if i not in lenient] == [
        (p, s) for i, (p, s, _) in enumerate(want) if i not in lenient
    ]
    tool_paths = (
        "/increment_counter",
        "/get_counter_value",
        "/ng-rollout/r-1/get_counter_value",
        "/seed_session",
    )
    # after /close_session ours has released the session (a fresh counter); the genuine example
    # keeps its dict: bodies are compared up to the first close only
    first_close = min(lenient)
    for (path, status, body), (_, _, genuine) in zip(got[:first_close], want[:first_close], strict=True):
        if (path in tool_paths and status == 200) or path.startswith("/livez"):
            assert body == genuine, path
        if status == 422 and path != "/close_session":
            assert [d["loc"] for d in body["detail"]] == [d["loc"] for d in genuine["detail"]], path
    verify = next(b for p, _, b in got if p == "/verify")
    assert verify["reward"] == 1.0
