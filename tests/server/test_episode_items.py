"""The shared step handling (``gymbridge.server._episode``) and the agent loop that uses it."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from raw_gym_env import BAD_STEPS, EXPECTED_ENV_ITEMS, ROW, env_items, raw_gym_app, step_answer

from gymbridge.errors import ProtocolError
from gymbridge.server import SimpleAgent, start_server
from gymbridge.server._episode import GymnasiumEpisode, StepAnswer, observation_message, tool_output_items
from gymbridge.testing.scripted_model import ScriptedModelServer


async def run_agent(row: dict[str, Any]) -> tuple[int, Any]:
    env = await start_server(raw_gym_app())
    model = ScriptedModelServer(["<action>go</action>"])
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url, gymnasium=True))
    try:
        async with aiohttp.ClientSession() as http, http.post(agent.url + "/run", json=row) as r:
            return r.status, await r.json(content_type=None)
    finally:
        await agent.stop()
        await model.stop()
        await env.stop()


async def test_agent_gymnasium_step_items_tool_outputs_then_observation() -> None:
    status, result = await run_agent(ROW)
    assert status == 200, result
    assert result["reward"] == 1.0 and result["terminated"] is True and result["truncated"] is False
    assert env_items(result["response"]["output"]) == EXPECTED_ENV_ITEMS  # the final step adds nothing
    reset_message = {"type": "message", "role": "user", "content": "start"}
    assert result["responses_create_params"]["input"][-1] == reset_message
    assert result["response"]["usage"]["output_tokens"] > 0  # summed over the three model calls


@pytest.mark.parametrize("bad", sorted(BAD_STEPS))
async def test_regression_malformed_step_answer_is_a_500_naming_it_not_skipped(bad: str) -> None:
    """Formerly: a non-object tool output was skipped and a non-bool flag read as truthy."""
    status, body = await run_agent({**ROW, "bad": bad})
    assert status == 500
    assert isinstance(body, str) and "invalid step response" in body


@pytest.mark.parametrize("bad", sorted(BAD_STEPS))
def test_step_answer_refuses_each_malformation(bad: str) -> None:
    with pytest.raises(ProtocolError):
        StepAnswer({**step_answer(1), **BAD_STEPS[bad]})


def test_episode_state_machine() -> None:
    episode = GymnasiumEpisode(ROW)
    episode.start({"observation": "start", "info": {"supports_explicit_close": True}})
    assert episode.supports_close
    assert episode.model_input() == [
        {"type": "message", "role": "user", "content": "play"},
        {"type": "message", "role": "user", "content": "start"},
    ]
    reply = {
        "output": [{"type": "message", "role": "assistant", "content": []}],
        "usage": {"output_tokens": 2},
    }
    body = episode.add_response(reply)
    assert body["response"] is reply and body["episode"] == "e"
    assert not episode.add_step(step_answer(1)).done
    result = episode.result()
    assert result["truncated"] is True and result["response"]["status"] == "incomplete"  # never finished
    episode.add_response(reply)
    assert episode.add_step({**step_answer(2), "truncated": True}).done
    result = episode.result()
    assert result["truncated"] is True and result["terminated"] is False
    assert result["response"]["status"] == "completed" and result["response"]["usage"]["output_tokens"] == 4
    with pytest.raises(ProtocolError, match="reset"):
        GymnasiumEpisode(ROW).start(["not", "an", "object"])
    with pytest.raises(ProtocolError, match="input"):
        GymnasiumEpisode({"responses_create_params": {"input": 3}})


def test_observation_prefers_content_parts() -> None:
    parts = [{"type": "input_text", "text": "t"}]
    assert observation_message({"observation": "x", "observation_content": parts})["content"] == parts
    assert observation_message({"observation": "x"})["content"] == "x"
    assert observation_message({"observation": "", "observation_content": []}) is None


def test_tool_output_items_split_media_from_text() -> None:
    import orjson

    parts = [
        {"type": "input_text", "text": "a"},
        {"type": "input_image", "image_url": "data:,", "detail": "auto"},
    ]
    body = orjson.dumps(parts)
    assert tool_output_items("c", body, "parts", "user_message") == [
        {"type": "function_call_output", "call_id": "c", "output": "a"},
        {"type": "message", "role": "user", "content": parts[1:]},
    ]
    assert tool_output_items("c", body, "parts", "output")[0]["output"] == parts
    assert tool_output_items("c", body, None, "output")[0]["output"] == body.decode()  # not marked: verbatim


def test_tool_episode_stop_rules() -> None:
    from gymbridge.server._episode import ToolEpisode

    call = {"type": "function_call", "call_id": "c1", "name": "t", "arguments": "{}"}
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}
    reasoning = {"type": "reasoning", "summary": []}

    episode = ToolEpisode({"input": "go"})
    assert episode.add_response({"output": [reasoning, call], "usage": {"output_tokens": 1}}) == [call]
    episode.outputs.append({"type": "function_call_output", "call_id": "c1", "output": "x"})
    assert episode.model_input()[0]["content"] == "go" and len(episode.model_input()) == 4
    assert episode.add_response({"output": [answer], "usage": {"output_tokens": 2}}) is None
    assert episode.response()["status"] == "completed" and episode.response()["usage"]["output_tokens"] == 3

    for output, reason in (([reasoning], "incomplete_reasoning"), ([], "empty_output")):
        episode = ToolEpisode({"input": "go"})
        assert episode.add_response({"output": output}) is None
        response = episode.response()
        assert response["status"] == "incomplete"
        assert response["metadata"]["ng_termination_reason"] == reason

    episode = ToolEpisode({"input": "go"})
    truncated = {"output": [answer], "incomplete_details": {"reason": "max_output_tokens"}}
    assert episode.add_response(truncated) is None
    assert episode.response()["status"] == "incomplete"
    episode = ToolEpisode({"input": "go"})
    episode.add_response({"output": [call]})
    episode.stop_at_max_steps()
    assert episode.response()["status"] == "incomplete"
    with pytest.raises(ProtocolError):
        ToolEpisode({"input": 7})


def test_regression_context_exhausted_episode_stops_instead_of_stepping_empty_actions() -> None:
    """Formerly: an empty ``incomplete`` answer (the prompt filled the context) was sent to /step
    as an empty action, and every later call ended the same way until ``max_steps``."""
    episode = GymnasiumEpisode(ROW)
    episode.start({"observation": "start", "info": {}})
    episode.add_response({"output": [], "status": "incomplete", "incomplete_details": {"reason": "length"}})
    assert episode.context_exhausted
    result = episode.result()
    assert result["response"]["status"] == "incomplete"
    assert result["response"]["metadata"]["ng_termination_reason"] == "empty_output"
    assert result["truncated"] is True and result["terminated"] is False
    # an answer with output (even a truncated one) is a real action
    episode2 = GymnasiumEpisode(ROW)
    episode2.start({"observation": "start", "info": {}})
    episode2.add_response({"output": [{"type": "message"}], "status": "incomplete"})
    assert not episode2.context_exhausted


async def test_agent_stops_a_gymnasium_episode_when_the_model_returns_nothing() -> None:
    from aiohttp import web

    model_calls = 0

    async def responses(request: web.Request) -> web.Response:
        nonlocal model_calls
        model_calls += 1
        body = {"id": "r", "object": "response", "model": "m", "output": [], "status": "incomplete"}
        return web.json_response({**body, "incomplete_details": {"reason": "max_output_tokens"}})

    model_app = web.Application()
    model_app.router.add_post("/v1/responses", responses)
    env = await start_server(raw_gym_app())
    model = await start_server(model_app)
    agent = await start_server(
        SimpleAgent(resources_url=env.url, model_url=model.url, gymnasium=True, max_steps=6)
    )
    try:
        async with aiohttp.ClientSession() as http, http.post(agent.url + "/run", json=ROW) as r:
            status, result = r.status, await r.json(content_type=None)
    finally:
        await agent.stop()
        await model.stop()
        await env.stop()
    assert status == 200, result
    assert model_calls == 1  # not max_steps calls
    assert result["response"]["metadata"]["ng_termination_reason"] == "empty_output"
    assert result["truncated"] is True
    assert env_items(result["response"]["output"]) == []  # no /step was taken
