"""SimpleAgent end to end against our environments and a scripted model server."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gymbridge.server import (
    HttpError,
    ResourcesServer,
    RunningServer,
    Session,
    SimpleAgent,
    VerifyResult,
    start_server,
    tool,
)
from gymbridge.server.examples import CounterEnv, StepCounterEnv, counter_rows, step_counter_rows
from gymbridge.testing.scripted_model import IMAGE_TOKEN_ID, ScriptedModelServer

TOKEN_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class Harness:
    def __init__(self, env: RunningServer, model: ScriptedModelServer, agent: RunningServer) -> None:
        self.env, self.model, self.agent = env, model, agent

    async def run(self, row: dict[str, Any], cookie: str | None = None) -> tuple[int, Any]:
        headers = {"Cookie": cookie} if cookie else {}
        async with (
            aiohttp.ClientSession() as http,
            http.post(self.agent.url + "/run", json=row, headers=headers) as r,
        ):
            return r.status, await r.json(content_type=None)


async def harness(env_server: ResourcesServer, script: Any, **agent_kwargs: Any) -> AsyncIterator[Harness]:
    env = await start_server(env_server)
    model = ScriptedModelServer(script)
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url, **agent_kwargs))
    try:
        yield Harness(env, model, agent)
    finally:
        await agent.stop()
        await model.stop()
        await env.stop()


def call(name: str, arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


async def test_tool_loop_replays_items_unchanged_and_verifies() -> None:
    script = [
        {"reasoning": "plan", "calls": [call("increment", {"amount": 1})]},
        {"calls": [call("increment", {"amount": 1})]},
        "done",
    ]
    row = {**counter_rows(1)[0], "target": 2}
    row["responses_create_params"] = {
        **row["responses_create_params"],
        "temperature": 0.7,
        "max_output_tokens": 64,
    }
    async for h in harness(CounterEnv(), script):
        status, result = await h.run(row)
        assert status == 200, result
        assert result["reward"] == pytest.approx(1.0)
        assert result["target"] == 2 and result["_ng_task_index"] == 0
        response = result["response"]
        assert response["status"] == "completed"
        kinds = [o["type"] for o in response["output"]]
        assert kinds == [
            "reasoning",
            "function_call",
            "function_call_output",
            "function_call",
            "function_call_output",
            "message",
        ]
        # the model saw exactly the row's responses_create_params, with only `input` grown
        rcp = row["responses_create_params"]
        for request in h.model.requests:
            assert set(request) == set(rcp)
            assert {k: v for k, v in request.items() if k != "input"} == {
                k: v for k, v in rcp.items() if k != "input"
            }
        # replayed items keep their token fields, byte for byte
        third_input = h.model.requests[2]["input"]
        assert third_input[len(rcp["input"]) :] == response["output"][:-1]
        # contiguous prompts: each call's prompt starts with the previous prompt + generation
        trained = [o for o in response["output"] if o.get("generation_token_ids")]
        assert len(trained) == 3
        for prev, nxt in itertools.pairwise(trained):
            prefix = prev["prompt_token_ids"] + prev["generation_token_ids"]
            assert nxt["prompt_token_ids"][: len(prefix)] == prefix


async def test_max_steps_default_is_eight_and_marks_incomplete() -> None:
    async for h in harness(CounterEnv(), [{"calls": [call("increment", {})]}]):
        status, result = await h.run(counter_rows(1)[0])
        assert status == 200
        assert h.model.num_calls == 8
        assert result["response"]["status"] == "incomplete"
        assert sum(1 for o in result["response"]["output"] if o["type"] == "function_call_output") == 8


@pytest.mark.parametrize(
    ("entry", "reason"),
    [({"reasoning": "only thinking"}, "incomplete_reasoning"), ({"incomplete": True}, None)],
)
async def test_reasoning_only_or_truncated_output_stops_incomplete(
    entry: dict[str, Any], reason: str | None
) -> None:
    async for h in harness(CounterEnv(), [entry, "never reached"]):
        status, result = await h.run(counter_rows(1)[0])
        assert status == 200 and h.model.num_calls == 1
        assert result["response"]["status"] == "incomplete"
        if reason:
            assert result["response"]["metadata"]["ng_termination_reason"] == reason


async def test_tool_errors_go_back_to_the_model() -> None:
    script = [
        {
            "calls": [
                call("increment", "{not json"),
                call("no_such_tool", {}),
                call("increment", {"amount": "lots"}),
                call("explode", {"reason": "kaput"}),
                call("../verify", {}),
            ]
        },
        "ok",
    ]
    async for h in harness(CounterEnv(), script):
        status, result = await h.run(counter_rows(1)[0])
        assert status == 200
        outputs = [o["output"] for o in result["response"]["output"] if o["type"] == "function_call_output"]
        assert outputs[0].startswith('{"error": "Invalid tool call arguments: JSONDecodeError')
        assert json.loads(outputs[1]) == {"detail": "Not Found"}
        assert json.loads(outputs[2])["detail"][0]["loc"] == ["body", "amount"]
        assert json.loads(outputs[3]) == "RuntimeError('kaput')"
        assert json.loads(outputs[4]) == {"detail": "Not Found"}


async def test_tool_image_comes_back_as_input_parts() -> None:
    script = [{"calls": [call("snapshot", {})]}, "seen"]
    async for h in harness(CounterEnv(), script):
        _, result = await h.run(counter_rows(1)[0])
        out = result["response"]["output"]
        assert [o["type"] for o in out] == ["function_call", "function_call_output", "message", "message"]
        assert out[1]["output"] == "count is 0"
        assert out[2]["role"] == "user" and out[2]["content"][0]["type"] == "input_image"
        # the model's second prompt delta holds exactly one image placeholder
        delta = out[3]["prompt_token_ids"][
            len(out[0]["prompt_token_ids"]) + len(out[0]["generation_token_ids"]) :
        ]
        assert delta.count(IMAGE_TOKEN_ID) == 1
    async for h in harness(CounterEnv(), script, tool_media="output"):
        _, result = await h.run(counter_rows(1)[0])
        out = result["response"]["output"]
        assert [p["type"] for p in out[1]["output"]] == ["input_text", "input_image"]


async def test_model_500_becomes_agent_500_with_json_string_body() -> None:
    async for h in harness(CounterEnv(), [{"status": 500, "body": {"error": "CUDA OOM"}}]):
        status, body = await h.run(counter_rows(1)[0])
        assert status == 500
        assert isinstance(body, str) and "CUDA OOM" in body and "calling an inner server" in body


async def test_bad_run_body_is_422_not_a_crash() -> None:
    async for h in harness(CounterEnv(), ["x"]):
        status, body = await h.run({"no": "params"})  # type: ignore[arg-type]
        assert status == 422 and body["detail"][0]["loc"] == ["body", "responses_create_params"]
        status, _ = await h.run({"responses_create_params": {"input": 5}})
        assert status == 422
        status, _ = await h.run(counter_rows(1)[0])
        assert status == 200


class SlowEnv(ResourcesServer):
    @tool
    async def wait(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "done"

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        return VerifyResult(reward=1.0)


async def test_hanging_tool_hits_the_tool_deadline() -> None:
    """A tool past its deadline is an environment fault: a masked result (gymbridge.faults), no verify."""
    async for h in harness(
        SlowEnv(), [{"calls": [call("wait", {"seconds": 3600})]}, "x"], tool_timeout_s=0.3
    ):
        started = asyncio.get_running_loop().time()
        status, body = await h.run(
            {"responses_create_params": {"input": "go", "tools": SlowEnv.function_tools()}}
        )
        assert status == 200 and body["mask_sample"] is True and body["reward"] == 0.0
        assert (
            body["failure_kind"] == "transport_timeout"
            and "tool 'wait' passed its deadline" in body["failure_reason"]
        )
        assert body["env_fault"] == {"route": "/wait", "tool": "wait", "status": None}
        # wallclock-ok: the tool deadline fired; the tool answers after an hour
        assert asyncio.get_running_loop().time() - started < 60


async def test_gymnasium_mode_images_every_turn() -> None:
    script = ["<action>inc</action>", "<action>inc</action>", "<action>stop</action>"]
    async for h in harness(StepCounterEnv(), script, gymnasium=True):
        row = {**step_counter_rows(1)[0], "target": 2}
        status, result = await h.run(row)
        assert status == 200
        assert result["reward"] == 1.0 and result["terminated"] is True and result["truncated"] is False
        out = result["response"]["output"]
        assert [(o["type"], o.get("role")) for o in out] == [
            ("message", "assistant"),
            ("message", "user"),
            ("message", "assistant"),
            ("message", "user"),
            ("message", "assistant"),
        ]
        assert all(
            p["type"] == "input_image" for o in out if o.get("role") == "user" for p in o["content"][1:]
        )
        # the reset observation joins the input, as stock gymnasium_agent does
        first_obs = result["responses_create_params"]["input"][-1]
        assert first_obs["role"] == "user" and first_obs["content"][1]["type"] == "input_image"
        assert result["target"] == 2


async def test_gymnasium_mode_truncates_at_max_steps() -> None:
    async for h in harness(StepCounterEnv(), ["<action>inc</action>"], gymnasium=True, max_steps=3):
        status, result = await h.run(step_counter_rows(1)[0])
        assert status == 200 and h.model.num_calls == 3
        assert result["truncated"] is True and result["terminated"] is False
        assert result["response"]["status"] == "incomplete"


class PickyEnv(ResourcesServer):
    async def seed_session(self, session: Session, row: dict[str, Any]) -> dict[str, Any] | None:
        if "target" not in row:
            raise HttpError(
                422, {"detail": [{"type": "missing", "loc": ["body", "target"], "msg": "Field required"}]}
            )
        return {}

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        return VerifyResult(reward=1.0)


async def test_row_refused_by_the_environment_keeps_its_4xx() -> None:
    async for h in harness(PickyEnv(), ["x"]):
        status, body = await h.run({"responses_create_params": {"input": "go"}})
        assert status == 422 and "target" in body
        status, _ = await h.run({"responses_create_params": {"input": "go"}, "target": 1})
        assert status == 200


async def counted_runs(
    env_server: ResourcesServer, script: Any, rows: list[dict[str, Any]], **kw: Any
) -> Any:
    """Run ``rows`` through a SimpleAgent we hold; its counters, in-process and over HTTP."""
    env = await start_server(env_server)
    model = ScriptedModelServer(script)
    await model.start()
    agent = SimpleAgent(resources_url=env.url, model_url=model.url, **kw)
    running = await start_server(agent)
    try:
        async with aiohttp.ClientSession() as http:
            for row in rows:
                async with http.post(running.url + "/run", json=row) as reply:
                    assert reply.status == 200, await reply.text()
            async with http.get(running.url + "/counters") as reply:
                over_http = await reply.json()
        return agent.counters(), over_http
    finally:
        await running.stop()
        await model.stop()
        await env.stop()


async def test_counters_time_every_environment_and_model_call_by_kind() -> None:
    """``SimpleAgent.counters()`` / ``GET /counters``: one interval per outbound call, by what it is."""
    script = [
        {"calls": [call("increment", {"amount": 1})]},
        {"calls": [call("increment", {"amount": 1})]},
        "done",
    ]
    counters, over_http = await counted_runs(CounterEnv(), script, counter_rows(2))
    assert over_http.keys() == counters.keys()
    assert counters["run_n"] == 2 and counters["env_seed_n"] == 2 and counters["env_verify_n"] == 2
    assert counters["env_tool_n"] == 4 and counters["model_n"] == 6
    for phase in ("run", "env_seed", "env_tool", "env_verify", "model"):
        assert 0 < counters[f"{phase}_busy_s"] <= counters[f"{phase}_s"]
    assert counters["env_verify_s"] + counters["model_s"] <= counters["run_s"]
    assert all(over_http[k] <= counters[k] for k in counters)  # read earlier: never larger


async def test_counters_of_a_gymnasium_run_count_reset_and_steps() -> None:
    counters, _ = await counted_runs(
        StepCounterEnv(), ["+1", "+1", "stop"], step_counter_rows(1), gymnasium=True
    )
    assert counters["env_seed_n"] == 1 and counters["run_n"] == 1
    assert counters["env_step_n"] == counters["model_n"] >= 1
