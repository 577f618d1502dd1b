"""Environment faults mid-episode against genuine NeMo Gym 0.7.0 (``gymbridge.faults``).

What genuine ``simple_agent`` does when a tool of our environment faults, and that ``GymClient``
classifies its result as an ``infra`` failure: a tool that raises ``HttpError(503)`` is shown to
the model, and our environment's ``/verify`` masks the result (``mask_sample`` + a ``transport_*``
``failure_kind``); a tool whose connection closes mid-body makes the genuine agent answer 500.
A proxy's 502 in front of the environment is shown to the model and scored by the genuine agent
(nothing can tell); gymbridge's agent in the same place ends the rollout masked. And the genuine
collector counts gymbridge's masked results as masked: no failure, no crash, left out of the mean.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _genuine import KIND_RESOURCES, GenuineStack
from _gym_support import (
    ScriptBook,
    ThreadedLoop,
    add_genuine_simple_agent,
    add_scripted_model,
    genuine_relay_to_our_agent,
    scripted,
)

import gymbridge.server as server_sdk
import gymbridge_envs.counter.data as counter_data
import gymbridge_envs.counter.server as counter_server
from gymbridge.client import GymClient
from gymbridge.testing.fault_proxy import Fault, FaultProxy

pytestmark = pytest.mark.gym


class Lookout(server_sdk.ResourcesServer):  # type: ignore[misc, name-defined]
    """One healthy tool and one whose backend is down (it answers 503 itself)."""

    @server_sdk.tool  # type: ignore[untyped-decorator]
    async def look(self) -> str:
        """Look around."""
        return "all clear"

    @server_sdk.tool  # type: ignore[untyped-decorator]
    async def render(self) -> str:
        """Render the scene (its renderer is down)."""
        raise server_sdk.HttpError(503, {"detail": "the renderer behind this tool is down"})

    async def verify(self, session: Any, row: dict[str, Any], response: dict[str, Any]) -> Any:
        return server_sdk.VerifyResult(reward=1.0)


ROW = {
    "responses_create_params": {
        "input": [{"role": "user", "content": "look"}],
        "tools": Lookout.function_tools(),
    }
}


@pytest.fixture(scope="module")
def lookout_stack(
    fixture_loop: ThreadedLoop, scripted_model_url: str, gym_log_root: Path
) -> Iterator[tuple[GenuineStack, FaultProxy]]:
    """Our Lookout behind a genuine simple_agent, and behind a FaultProxy behind another one."""
    env = fixture_loop.run(server_sdk.start_server(Lookout(instance_name="ours_lookout")))
    proxy = FaultProxy(env.url)
    fixture_loop.run(proxy.__aenter__())
    stack = GenuineStack(gym_log_root / "env_faults")
    add_scripted_model(stack, scripted_model_url)
    stack.add("ours_lookout", KIND_RESOURCES, "lookout", port=env.port, launch=False)
    stack.add(
        "proxied_lookout", KIND_RESOURCES, "lookout", port=int(proxy.url.rsplit(":", 1)[1]), launch=False
    )
    add_genuine_simple_agent(stack, "agent_direct", "ours_lookout", max_steps=4)
    add_genuine_simple_agent(stack, "agent_proxied", "proxied_lookout", max_steps=4)
    try:
        stack.start()
        yield stack, proxy
    finally:
        stack.stop()
        fixture_loop.run(proxy.__aexit__(None, None, None))
        fixture_loop.run(env.stop())


async def _run(agent_url: str, row: dict[str, Any], attempts: int = 2) -> Any:
    async with GymClient(agent_url, max_attempts=attempts, backoff_initial_s=0.01, deadline_s=120) as client:
        return await client.run(row)


async def test_genuine_simple_agent_and_our_faulting_tool_give_a_masked_result_our_client_calls_infra(
    lookout_stack: tuple[GenuineStack, FaultProxy], script_book: ScriptBook
) -> None:
    stack, _ = lookout_stack
    row = scripted(
        ROW, script_book.add("render-503", [{"calls": [{"name": "render", "arguments": {}}]}, "done"])
    )
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        raw = await http.post(stack.url("agent_direct") + "/run", json=row)
    # the genuine agent shows the 503 to the model and scores on; our verify masks it in 0.7.0's terms
    assert raw.status_code == 200
    result = raw.json()
    outputs = [i["output"] for i in result["response"]["output"] if i["type"] == "function_call_output"]
    assert json.loads(outputs[0]) == {"detail": "the renderer behind this tool is down"}
    assert (result["mask_sample"], result["failure_kind"]) == (True, "transport_unreachable")
    assert result["env_fault"] == {"route": "/render", "tool": "render", "status": 503}
    outcome = await _run(stack.url("agent_direct"), row)
    assert (outcome.kind, outcome.status, outcome.attempts) == ("infra", 503, 2)
    assert "tool 'render' answered HTTP 503" in (outcome.reason or "")


async def test_genuine_simple_agent_on_a_connection_closed_mid_body_answers_500_our_client_retries(
    lookout_stack: tuple[GenuineStack, FaultProxy], script_book: ScriptBook
) -> None:
    stack, proxy = lookout_stack
    proxy.faults["/look"] = Fault("close_mid_body")
    try:
        row = scripted(
            ROW, script_book.add("look-drop", [{"calls": [{"name": "look", "arguments": {}}]}, "done"])
        )
        outcome = await _run(stack.url("agent_proxied"), row)
    finally:
        del proxy.faults["/look"]
    assert (outcome.kind, outcome.status, outcome.attempts) == ("infra", 500, 2)
    assert "ClientPayloadError" in (outcome.reason or "") or "payload" in (outcome.reason or "").lower()


async def test_a_proxy_502_is_scored_by_genuine_simple_agent_and_masked_by_ours(
    lookout_stack: tuple[GenuineStack, FaultProxy], script_book: ScriptBook, scripted_model_url: str
) -> None:
    """Genuine 0.7.0 fact: a gateway's 502 in front of the environment reaches the model as the
    tool's output and the rollout is scored (the environment never saw it). gymbridge's agent in
    the same place ends the rollout masked, and the client records an infra failure."""
    stack, proxy = lookout_stack
    proxy.faults["/look"] = Fault(502)
    try:
        row = scripted(
            ROW, script_book.add("look-502", [{"calls": [{"name": "look", "arguments": {}}]}, "done"])
        )
        genuine = await _run(stack.url("agent_proxied"), row)
        ours = server_sdk.SimpleAgent(resources_url=proxy.url, model_url=scripted_model_url)
        async with await server_sdk.start_server(ours) as agent:
            outcome = await _run(agent.url, row)
    finally:
        del proxy.faults["/look"]
    assert genuine.ok and genuine.result is not None and genuine.result["reward"] == 1.0
    outputs = [
        i["output"] for i in genuine.result["response"]["output"] if i["type"] == "function_call_output"
    ]
    assert "502 injected by FaultProxy" in outputs[0]
    assert (outcome.kind, outcome.status) == ("infra", 502)
    assert "tool 'look' answered HTTP 502" in (outcome.reason or "")


@pytest.fixture
def our_agent_behind_genuine_relay(
    fixture_loop: ThreadedLoop, scripted_model_url: str, tmp_path: Path
) -> Iterator[GenuineStack]:
    """Genuine legacy_agent relay -> our SimpleAgent -> FaultProxy (get_counter_value: 502) -> our counter."""
    env = fixture_loop.run(
        server_sdk.start_server(counter_server.CounterServer(instance_name="ours_counter"))
    )
    proxy = FaultProxy(env.url, {"/get_counter_value": Fault(502)})
    fixture_loop.run(proxy.__aenter__())
    try:
        with genuine_relay_to_our_agent(
            fixture_loop, proxy.url, scripted_model_url, tmp_path / "logs"
        ) as stack:
            yield stack
    finally:
        fixture_loop.run(proxy.__aexit__(None, None, None))
        fixture_loop.run(env.stop())


def test_genuine_collector_counts_our_masked_env_faults_as_masked(
    our_agent_behind_genuine_relay: GenuineStack, script_book: ScriptBook, tmp_path: Path
) -> None:
    """4 tasks x 2 repeats; task 3 reads the counter through a tool that 502s. The genuine collector
    keeps all 8 rollouts, records no failure, and its mean reward leaves the 2 masked ones out."""
    rows: list[dict[str, Any]] = []
    for i, row in enumerate(counter_data.generate(4, seed=5)):
        steps = [
            {"calls": [{"name": "increment_counter", "arguments": {"count": k}}]} for k in row["increments"]
        ]
        if i == 3:
            steps.append({"calls": [{"name": "get_counter_value", "arguments": {}}]})
        row = copy.deepcopy(row)
        row["responses_create_params"]["metadata"] = {
            "script": script_book.add(f"collector-fault-{i}", [*steps, "done"])
        }
        rows.append(row)
    inp, out = tmp_path / "rows.jsonl", tmp_path / "rollouts.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = our_agent_behind_genuine_relay.collect(
        "ours_agent", inp, out, num_repeats=2, num_samples_in_parallel=4
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    rollouts = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rollouts) == 8
    masked = sorted(r["_ng_task_index"] for r in rollouts if r.get("mask_sample"))
    assert masked == [3, 3]
    assert {r["failure_kind"] for r in rollouts if r.get("mask_sample")} == {"transport_unreachable"}
    assert all(r["reward"] == 1.0 for r in rollouts if not r.get("mask_sample"))
    assert (tmp_path / "rollouts_failures.jsonl").read_text() == ""
    (metrics,) = json.loads((tmp_path / "rollouts_aggregate_metrics.json").read_text())
    assert metrics["agent_metrics"]["mean/reward"] == pytest.approx(1.0)  # the masked are not scores
    assert metrics["agent_metrics"]["num_masked"] == 2
