"""An environment fault in the middle of an episode is an infrastructure failure, never a trained rollout.

A tool route that answered 502, or closed the connection in the middle of its body, used to end
the rollout with an agent 5xx; a genuine ``run_examples`` raises on that and ends every rollout in
flight. The agent now ends such a rollout with a masked result (0.7.0's ``mask_sample`` +
``failure_kind``; ``gymbridge.faults``), which ``GymClient`` retries and, if the fault stays,
records as an ``infra`` failure naming the tool and the status. Tool errors the environment
means the model to read (a 4xx with its message, an error payload, a raising tool's 500) stay
tool outputs. Faults are injected on loopback by :class:`~gymbridge.testing.fault_proxy.FaultProxy`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gymbridge.bridge import BridgeConfig, BridgeIterator, BridgeStalledError, GymRollouts
from gymbridge.client import GymClient
from gymbridge.server import (
    HttpError,
    ResourcesServer,
    Session,
    SimpleAgent,
    VerifyResult,
    start_server,
    tool,
)
from gymbridge.server.examples import StepCounterEnv, step_counter_rows
from gymbridge.testing.fault_proxy import Fault, FaultProxy
from gymbridge.testing.scripted_model import ScriptedModelServer


class Lookout(ResourcesServer):
    """Tools that answer normally, with errors meant for the model, or with a fault of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.verified = 0

    @tool
    async def look(self) -> str:
        return "all clear"

    @tool
    async def refuse(self) -> str:
        raise HttpError(422, {"detail": "bbox must lie inside the image"})

    @tool
    async def error_payload(self) -> dict[str, str]:
        return {"error": "nothing to see there"}

    @tool
    async def explode(self) -> str:
        raise RuntimeError("kaboom")

    @tool
    async def backend_down(self) -> str:
        raise HttpError(503, {"detail": "the renderer behind this tool is down"})

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        self.verified += 1
        return VerifyResult(reward=1.0)


ROW = {"responses_create_params": {"input": "look around", "tools": Lookout.function_tools()}, "task": 7}
LOOK = [{"calls": [{"name": "look", "arguments": {}}]}, "done"]


async def post_run(url: str, row: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url + "/run", json=row) as reply:
        return reply.status, await reply.json(content_type=None)


FAULTS: list[tuple[int | str, str, int | None, str]] = [
    (502, "transport_unreachable", 502, "answered HTTP 502"),
    (503, "transport_unreachable", 503, "answered HTTP 503"),
    (504, "transport_timeout", 504, "answered HTTP 504"),
    (429, "transport_unreachable", 429, "answered HTTP 429"),
    (408, "transport_timeout", 408, "answered HTTP 408"),
    ("close_mid_body", "transport_peer_drop", None, "broke the connection"),
    ("close", "transport_peer_drop", None, "broke the connection"),
]


@pytest.mark.parametrize(("fault", "kind", "status", "how"), FAULTS)
async def test_regression_a_tool_fault_mid_episode_is_an_infra_failure_never_trained(
    fault: Any, kind: str, status: int | None, how: str, tmp_path: Path
) -> None:
    env_server = Lookout()
    failures = tmp_path / "failures.jsonl"
    async with (
        await start_server(env_server) as env,
        FaultProxy(env.url, {"/look": Fault(fault)}) as proxy,
        ScriptedModelServer(LOOK) as model,
        await start_server(SimpleAgent(resources_url=proxy.url, model_url=model.url)) as agent,
    ):
        code, result = await post_run(agent.url, ROW)
        async with GymClient(agent.url, max_attempts=2, backoff_initial_s=0.01) as client:
            outcomes = [o async for o in client.run_many([ROW], progress=False, failures_path=failures)]
    # what a genuine consumer sees: a completed, masked sample (never scored, never trained)
    assert code == 200
    assert (result["mask_sample"], result["reward"], result["failure_kind"]) == (True, 0.0, kind)
    assert result["env_fault"] == {"route": "/look", "tool": "look", "status": status}
    assert f"tool 'look' {how}" in result["failure_reason"]
    assert result["task"] == 7 and result["response"]["status"] == "incomplete"
    assert result["response"]["metadata"]["ng_termination_reason"] == "env_fault"
    assert [i["type"] for i in result["response"]["output"]] == ["function_call"]  # the call, no output
    assert env_server.verified == 0  # no reward was computed after the fault
    # what GymClient does: retries it, then records an infra failure naming the tool and the status
    (outcome,) = outcomes
    assert not outcome.ok and outcome.kind == "infra" and outcome.attempts == 2
    assert outcome.status == status and f"tool 'look' {how}" in (outcome.reason or "")
    (record,) = [json.loads(line) for line in failures.read_text().splitlines()]
    assert (record["kind"], record["status"], record["attempts"]) == ("infra", status, 2)
    assert f"tool 'look' {how}" in record["reason"] and record["row"] == ROW
    assert proxy.injected["/look"] == 3


async def test_tool_errors_meant_for_the_model_stay_tool_outputs() -> None:
    """A 4xx with its message, an error payload and a raising tool's 500 are the tool's answers."""
    script: list[Any] = [
        {"calls": [{"name": n, "arguments": {}} for n in ("refuse", "error_payload", "explode", "nope")]},
        "done",
    ]
    env_server = Lookout()
    async with (
        await start_server(env_server) as env,
        ScriptedModelServer(script) as model,
        await start_server(SimpleAgent(resources_url=env.url, model_url=model.url)) as agent,
        GymClient(agent.url) as client,
    ):
        outcome = await client.run(ROW)
    assert outcome.ok and outcome.attempts == 1 and outcome.result is not None
    result = outcome.result
    assert result["reward"] == 1.0 and result["mask_sample"] is False and result["failure_kind"] is None
    outputs = [
        json.loads(o["output"]) for o in result["response"]["output"] if o["type"] == "function_call_output"
    ]
    assert outputs == [
        {"detail": "bbox must lie inside the image"},
        {"error": "nothing to see there"},
        "RuntimeError('kaboom')",
        {"detail": "Not Found"},
    ]
    assert env_server.verified == 1


async def test_a_fault_that_clears_on_retry_is_trained_normally() -> None:
    env_server = Lookout()
    async with (
        await start_server(env_server) as env,
        FaultProxy(env.url, {"/look": Fault(502, times=1)}) as proxy,
        ScriptedModelServer(LOOK) as model,
        await start_server(SimpleAgent(resources_url=proxy.url, model_url=model.url)) as agent,
        GymClient(agent.url, max_attempts=3, backoff_initial_s=0.01) as client,
    ):
        outcome = await client.run(ROW)
    assert outcome.ok and outcome.attempts == 2 and outcome.result is not None
    assert outcome.result["reward"] == 1.0 and outcome.result["mask_sample"] is False
    assert proxy.injected["/look"] == 1 and env_server.verified == 1


async def test_regression_an_env_fault_never_reaches_a_trained_batch(tmp_path: Path) -> None:
    """Through the bridge: each rollout is a ``gym_infra`` record naming the tool and the status."""
    failures = tmp_path / "failures.jsonl"
    async with (
        await start_server(Lookout()) as env,
        FaultProxy(env.url, {"/look": Fault(502)}) as proxy,
        ScriptedModelServer(LOOK) as model,
        await start_server(SimpleAgent(resources_url=proxy.url, model_url=model.url)) as agent,
        GymClient(agent.url, max_attempts=2, backoff_initial_s=0.01) as client,
    ):
        config = BridgeConfig(
            group_size=2, prompts_per_step=1, min_group_size=None, max_consecutive_failed_groups=8
        )
        it = BridgeIterator([ROW], GymRollouts(client), None, config, failures_path=failures)
        with pytest.raises(BridgeStalledError, match="without a single completed group"):
            await it.__anext__()
    assert it.stats.batches == 0 and it.stats.rollouts_ok == 0
    records = [json.loads(line) for line in failures.read_text().splitlines()]
    rollouts = [r for r in records if r["kind"] == "rollout"]
    assert [(r["rollout_index"], r["failure_class"], r["attempts"]) for r in rollouts] == [
        (0, "gym_infra", 2),
        (1, "gym_infra", 2),
    ]
    assert all("tool 'look' answered HTTP 502" in r["failure_reason"] for r in rollouts)


async def test_a_step_fault_ends_a_gymnasium_rollout_masked() -> None:
    row = step_counter_rows(1)[0]
    async with (
        await start_server(StepCounterEnv()) as env,
        FaultProxy(env.url, {"/step": Fault(503)}) as proxy,
        ScriptedModelServer(["up"]) as model,
        await start_server(
            SimpleAgent(resources_url=proxy.url, model_url=model.url, gymnasium=True)
        ) as agent,
        GymClient(agent.url, max_attempts=1) as client,
    ):
        code, result = await post_run(agent.url, row)
        outcome = await client.run(row)
    assert code == 200 and result["mask_sample"] is True and result["reward"] == 0.0
    assert result["env_fault"] == {"route": "/step", "tool": None, "status": 503}
    assert (
        result["failure_kind"] == "transport_unreachable"
        and "/step answered HTTP 503" in result["failure_reason"]
    )
    assert outcome.kind == "infra" and outcome.status == 503


async def test_v1_responses_passthrough_answers_a_tool_fault_with_502() -> None:
    """Stock ``/v1/responses`` has no result to mask: the fault is an upstream failure (502)."""
    async with (
        await start_server(Lookout()) as env,
        FaultProxy(env.url, {"/look": Fault("close_mid_body")}) as proxy,
        ScriptedModelServer(LOOK) as model,
        await start_server(SimpleAgent(resources_url=proxy.url, model_url=model.url)) as agent,
        aiohttp.ClientSession() as http,
        http.post(agent.url + "/v1/responses", json=ROW["responses_create_params"]) as reply,
    ):
        assert reply.status == 502
        assert "tool 'look' broke the connection" in await reply.json(content_type=None)


async def test_an_environment_remembers_its_own_tool_fault_and_masks_verify() -> None:
    """A stock agent shows a tool's 503 to the model and scores on: our environment's ``verify``
    then masks the result in 0.7.0's terms, so any consumer leaves it out."""
    async with await start_server(Lookout()) as env, aiohttp.ClientSession() as http:
        async with http.post(env.url + "/seed_session", json=ROW) as seed:
            cookies = {k: v.value for k, v in seed.cookies.items()}
        async with http.post(env.url + "/backend_down", json={}, cookies=cookies) as call:
            assert call.status == 503
        verify_body = {**ROW, "response": {"output": []}}
        async with http.post(env.url + "/verify", json=verify_body, cookies=cookies) as verify:
            result = await verify.json()
        async with http.post(env.url + "/seed_session", json=ROW) as seed:
            fresh = {k: v.value for k, v in seed.cookies.items()}
        async with http.post(env.url + "/verify", json=verify_body, cookies=fresh) as verify:
            clean = await verify.json()
    assert (result["mask_sample"], result["failure_kind"]) == (True, "transport_unreachable")
    assert result["env_fault"] == {"route": "/backend_down", "tool": "backend_down", "status": 503}
    assert "tool 'backend_down' answered HTTP 503" in result["failure_reason"]
    assert (clean["mask_sample"], clean["failure_kind"]) == (False, None)  # per session
