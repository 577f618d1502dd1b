"""A model server's refusal of a row's sampling parameters is a data failure at once, never retried.

Behind a stock NeMo Gym server the refusal arrives as a 500: genuine ``simple_agent`` (and
genuine ``vllm_model`` in front of vLLM) answers ``"Hit an exception in <server> calling an inner
server: b'<the inner body>'"`` whatever the inner status was. ``GymClient`` retried those as
infrastructure faults (two or three attempts of a request that can only be refused again); now a
wrapped 4xx is a ``data`` failure with the inner status, and gymbridge's agent answers it with
the inner 4xx. Bodies are built exactly as the genuine middleware builds them.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.client import GymClient
from gymbridge.faults import wrapped_client_error
from gymbridge.server import SimpleAgent, start_server
from gymbridge.server.examples import CounterEnv, counter_rows
from gymbridge.testing.scripted_model import ScriptedModelServer

VLLM_400 = {
    "object": "error",
    "message": "temperature must be non-negative, got -1.0.",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}


def genuine_wrap(server: str, inner: bytes) -> str:
    """The text of a genuine server's 500: its exception middleware's JSON string."""
    return f"Hit an exception in {server} calling an inner server: {inner!r}"


def client_for(status: int, body: Any) -> GymClient:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=body)

    return GymClient(
        "http://agent.test", transport=httpx.MockTransport(handler), max_attempts=3, backoff_initial_s=0.0
    )


@pytest.mark.parametrize(
    ("inner", "status"),
    [
        (json.dumps(VLLM_400).encode(), 400),
        (
            json.dumps(
                {"error": {"type": "invalid_request_error", "param": "temperature", "code": None}}
            ).encode(),
            400,
        ),
        (
            json.dumps(
                {"detail": [{"type": "extra_forbidden", "loc": ["body", "temp"], "msg": "Extra inputs"}]}
            ).encode(),
            422,
        ),
    ],
)
async def test_regression_a_refusal_wrapped_in_a_genuine_500_is_data_not_retried(
    inner: bytes, status: int
) -> None:
    async with client_for(500, genuine_wrap("SimpleAgent___counter_agent", inner)) as client:
        outcome = await client.run({"responses_create_params": {"input": "hi", "temperature": -1.0}})
    assert (outcome.kind, outcome.attempts, outcome.status) == ("data", 1, status)
    assert f"inner server's HTTP {status}" in (outcome.reason or "")


@pytest.mark.parametrize("code", [500, 503, 429, 408])
async def test_a_wrapped_infrastructure_fault_is_still_retried(code: int) -> None:
    inner = json.dumps({**VLLM_400, "code": code}).encode()
    async with client_for(500, genuine_wrap("vllm_model", inner)) as client:
        outcome = await client.run({"responses_create_params": {"input": "hi"}})
    assert (outcome.kind, outcome.attempts, outcome.status) == ("infra", 3, 500)


def test_nested_wrappers_are_unwrapped() -> None:
    """gymbridge's agent (before it unwrapped) -> genuine vllm_model -> vLLM's 400."""
    vllm_model_500 = json.dumps(genuine_wrap("vllm_model", json.dumps(VLLM_400).encode()))
    outer = f"Hit an exception in SimpleAgent___simple_agent calling an inner server: {vllm_model_500}"
    assert wrapped_client_error(500, json.dumps(outer)) == 400
    assert wrapped_client_error(502, json.dumps(outer)) is None  # only a 500 wraps


def test_a_hostile_wrapped_body_is_never_evaluated() -> None:
    hostile = "Hit an exception in x calling an inner server: b'{}' + __import__('os').getpid().to_bytes(8)"
    assert wrapped_client_error(500, json.dumps(hostile)) is None


@given(st.text(max_size=300))
def test_wrapped_client_error_never_raises(text: str) -> None:
    for body in (
        text,
        json.dumps(text),
        json.dumps(f"Hit an exception in x calling an inner server: {text}"),
    ):
        assert wrapped_client_error(500, body) in (None, *range(400, 500))


async def test_regression_our_agent_unwraps_a_model_servers_wrapped_refusal() -> None:
    """gymbridge's agent in front of a stock model server (genuine vllm_model wraps vLLM's 400 in a
    500) answered 500, which the client retried; it now answers the inner 400."""
    wrapped = genuine_wrap("VLLMModel___policy_model", json.dumps(VLLM_400).encode())
    async with (
        await start_server(CounterEnv()) as env,
        ScriptedModelServer([{"status": 500, "body": wrapped}]) as model,
        await start_server(SimpleAgent(resources_url=env.url, model_url=model.url)) as agent,
        GymClient(agent.url, backoff_initial_s=0.01) as client,
    ):
        outcome = await client.run(counter_rows(1)[0])
        assert model.num_calls == 1
    assert (outcome.kind, outcome.attempts, outcome.status) == ("data", 1, 400)
    assert "temperature must be non-negative" in (outcome.reason or "")
