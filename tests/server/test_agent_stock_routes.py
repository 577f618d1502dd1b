"""SimpleAgent's stock routes: ``/ng-rollout/<id>`` forwarding and the ``POST /v1/responses`` passthrough.

Genuine simple_agent (nemo-gym 0.7.0) carries a rollout id from the inbound path (or, with
observability on, from the row) onto its model and resources calls, and serves
``/v1/responses`` (plain, prefixed, and with the ``training-token-capture`` segment).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gymbridge.server import GymServer, RunningServer, SimpleAgent, rollout_id_from_row, start_server
from gymbridge.server.examples import CounterEnv, StepCounterEnv, counter_rows, step_counter_rows
from gymbridge.testing.scripted_model import ScriptedModelServer

SCRIPT = [{"calls": [{"name": "increment", "arguments": {"amount": 1}}]}, "done"]


class RecordingMixin(GymServer):
    """Remembers every request path exactly as it arrived (prefix included)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.paths: list[str] = []

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path)
        return await super()._dispatch(request)


class RecordingCounterEnv(RecordingMixin, CounterEnv):
    pass


class RecordingStepEnv(RecordingMixin, StepCounterEnv):
    pass


class Stack:
    def __init__(self, env: Any, env_run: RunningServer, model: ScriptedModelServer, agent: RunningServer):
        self.env, self.env_run, self.model, self.agent = env, env_run, model, agent


async def stack(
    env: RecordingCounterEnv | RecordingStepEnv, script: Any = SCRIPT, **kwargs: Any
) -> AsyncIterator[Stack]:
    env_run = await start_server(env)
    model = ScriptedModelServer(script)
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env_run.url, model_url=model.url, **kwargs))
    try:
        yield Stack(env, env_run, model, agent)
    finally:
        await agent.stop()
        await model.stop()
        await env_run.stop()


async def post(url: str, body: Any, cookie: str | None = None) -> tuple[int, Any, dict[str, str]]:
    headers = {"Cookie": cookie} if cookie else {}
    async with (
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http,
        http.post(url, json=body, headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None), {k: m.value for k, m in r.cookies.items()}


def row(**extra: Any) -> dict[str, Any]:
    return {**counter_rows(1)[0], "target": 1, **extra}


async def test_inbound_rollout_prefix_is_forwarded_to_model_and_resources() -> None:
    """Regression (issue 5 review): the agent dropped ``/ng-rollout/<id>`` on its outbound calls."""
    async for s in stack(RecordingCounterEnv()):
        status, result, _ = await post(s.agent.url + "/ng-rollout/t3-r1/run", row())
        assert status == 200 and result["reward"] == pytest.approx(1.0), result
        assert s.model.request_paths == ["/ng-rollout/t3-r1/v1/responses"] * 2
        assert s.env.paths == [
            "/ng-rollout/t3-r1/seed_session",
            "/ng-rollout/t3-r1/increment",
            "/ng-rollout/t3-r1/verify",
        ]


async def test_rollout_id_from_the_row_only_when_enabled() -> None:
    ids = {"_ng_task_index": 4, "_ng_rollout_index": 2, "_ng_attempt_index": 1}
    async for s in stack(RecordingCounterEnv()):
        status, _, _ = await post(s.agent.url + "/run", row(**ids))
        assert status == 200
        assert s.model.request_paths == ["/v1/responses"] * 2  # default: like stock with observability off
        assert s.env.paths == ["/seed_session", "/increment", "/verify"]
    async for s in stack(RecordingCounterEnv(), rollout_prefix=True):
        status, result, _ = await post(s.agent.url + "/run", row(**ids))
        assert status == 200 and result["reward"] == pytest.approx(1.0)
        assert s.model.request_paths == ["/ng-rollout/4-2-a1/v1/responses"] * 2
        assert all(p.startswith("/ng-rollout/4-2-a1/") for p in s.env.paths), s.env.paths
        # an explicit id wins; a row without identity goes unprefixed
        status, _, _ = await post(s.agent.url + "/run", row(_ng_rollout_id="ev.7_x", _ng_task_index=0))
        assert status == 200 and s.model.request_paths[-1] == "/ng-rollout/ev.7_x/v1/responses"
        bare = row()
        bare.pop("_ng_task_index", None)
        status, _, _ = await post(s.agent.url + "/run", bare)
        assert status == 200 and s.model.request_paths[-1] == "/v1/responses"
        # a malformed explicit id is the row's fault: 422 (data), never a 500
        status, body, _ = await post(s.agent.url + "/run", row(_ng_rollout_id="../etc"))
        assert status == 422 and "_ng_rollout_id" in body


async def test_gymnasium_calls_carry_the_prefix() -> None:
    env = RecordingStepEnv()
    async for s in stack(env, ["<action>inc</action>", "<action>stop</action>"], gymnasium=True):
        status, _, _ = await post(s.agent.url + "/ng-rollout/g-1/run", step_counter_rows(1)[0])
        assert status == 200
        assert env.paths and all(p.startswith("/ng-rollout/g-1/") for p in env.paths), env.paths
        assert {p.rsplit("/", 1)[-1] for p in env.paths} >= {"reset", "step"}
        assert set(s.model.request_paths) == {"/ng-rollout/g-1/v1/responses"}


def test_rollout_id_from_row_matches_stock_rules() -> None:
    assert rollout_id_from_row({"_ng_task_index": 0, "_ng_rollout_index": 5}) == "0-5"
    assert rollout_id_from_row({"_ng_task_index": 0, "_ng_rollout_index": 5, "_ng_attempt_index": 0}) == "0-5"
    assert rollout_id_from_row({"_ng_rollout_id": "abc", "_ng_attempt_index": 3}) == "abc-a3"
    assert rollout_id_from_row({"_ng_task_index": 1}) is None
    for bad in ("", ".hidden", "a/b", 7):
        with pytest.raises(ValueError, match="_ng_rollout_id"):
            rollout_id_from_row({"_ng_rollout_id": bad})


async def test_v1_responses_passthrough_runs_the_tool_loop_and_returns_cookies() -> None:
    """Regression (issue 5 review): genuine simple_agent serves ``POST /v1/responses``; ours did not."""
    async for s in stack(RecordingCounterEnv()):
        # a stock caller seeds the resources server itself, then hands its cookie to the agent
        status, _, env_cookies = await post(s.env_run.url + "/seed_session", row())
        assert status == 200
        env_cookie = "; ".join(f"{k}={v}" for k, v in env_cookies.items())
        rcp = row()["responses_create_params"]
        status, response, set_cookies = await post(s.agent.url + "/v1/responses", rcp, env_cookie)
        assert status == 200, response
        assert [o["type"] for o in response["output"]] == ["function_call", "function_call_output", "message"]
        assert response["output"][-1]["generation_token_ids"]
        assert json.loads(response["output"][1]["output"]) == {"count": 1}
        # the agent hands back the resources session (and the model's cookie) for the caller's /verify
        assert set_cookies.get(s.env.cookie_name) == env_cookies[s.env.cookie_name]
        assert s.model.cookie_name in set_cookies
        verify_body = {**row(), "response": response}
        status, result, _ = await post(s.env_run.url + "/verify", verify_body, env_cookie)
        assert status == 200 and result["reward"] == pytest.approx(1.0)
        # the model saw the create params exactly, only ``input`` grown
        assert {k: v for k, v in s.model.requests[0].items() if k != "input"} == {
            k: v for k, v in rcp.items() if k != "input"
        }


async def test_v1_responses_prefixed_and_token_capture_paths() -> None:
    async for s in stack(RecordingCounterEnv()):
        rcp = row()["responses_create_params"]
        status, _, _ = await post(s.agent.url + "/ng-rollout/r9/v1/responses", rcp)
        assert status == 200
        status, _, _ = await post(s.agent.url + "/ng-rollout/r9/training-token-capture/v1/responses", rcp)
        assert status == 200
        assert s.model.request_paths == [
            "/ng-rollout/r9/v1/responses",
            "/ng-rollout/r9/v1/responses",
            "/ng-rollout/r9/training-token-capture/v1/responses",
            "/ng-rollout/r9/training-token-capture/v1/responses",
        ]
        assert s.env.paths == ["/ng-rollout/r9/increment"] * 2
        # a malformed body is a 4xx with a JSON error, not a crash
        status, body, _ = await post(s.agent.url + "/v1/responses", [1, 2])
        assert status == 422 and "detail" in body


async def test_gymnasium_v1_responses_is_one_model_call_like_stock_gymnasium_agent() -> None:
    env = RecordingStepEnv()
    async for s in stack(env, ["<action>inc</action>"], gymnasium=True):
        rcp = step_counter_rows(1)[0]["responses_create_params"]
        status, response, set_cookies = await post(s.agent.url + "/v1/responses", rcp)
        assert status == 200, response
        assert [o["type"] for o in response["output"]] == ["message"]
        assert s.model.num_calls == 1 and env.paths == []  # the environment is not touched
        assert s.model.cookie_name in set_cookies
