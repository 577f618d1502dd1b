"""The model server: the shapes genuine vllm_model / simple_agent read, errors, batching, the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gen_helpers import png_data_url

from gymbridge.generation.batching import BatchingGenerator
from gymbridge.generation.chat import chat_to_messages
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.server import ModelServer, ModelServerConfig

pytestmark = pytest.mark.integration

TOOLS = [
    {"type": "function", "function": {"name": "zoom", "parameters": {"type": "object", "properties": {}}}}
]
RESPONSES_TOOLS = [
    {"type": "function", "name": "zoom", "parameters": {"type": "object", "properties": {}}, "strict": True}
]


@pytest.fixture
async def server(tiny_gen: HFGenerator) -> AsyncIterator[ModelServer]:
    config = ModelServerConfig(
        model_name="tiny", max_model_len=600, default_max_tokens=8, batch_window_s=0.02
    )
    srv = ModelServer(tiny_gen, config=config)
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def client(server: ModelServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=str(server.url), timeout=60) as c:
        yield c


def vllm_model_token_fields(body: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    """What genuine vllm_model (0.7.0) extracts from a chat completion, with its checks."""
    choice = body["choices"][0]
    prompt, gen = body.get("prompt_token_ids"), choice.get("token_ids")
    assert isinstance(prompt, list) and isinstance(gen, list)
    ids, lps = [], []
    for entry in choice["logprobs"]["content"]:
        token = entry["token"]
        assert isinstance(token, str) and token.startswith("token_id:")
        assert isinstance(entry["logprob"], float)
        ids.append(int(token.removeprefix("token_id:")))
        lps.append(entry["logprob"])
    assert ids == gen, "vLLM response generation token IDs disagree with choice logprob token IDs"
    return prompt, gen, lps


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The body genuine vllm_model sends (return_token_id_information: true)."""
    return {
        "model": "tiny",
        "messages": messages,
        "tools": TOOLS,
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
        **extra,
    }


async def test_chat_completion_has_the_vllm_token_shape(
    client: httpx.AsyncClient, tiny_gen: HFGenerator
) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": png_data_url(), "detail": "auto"}},
                {"type": "text", "text": "hi"},
            ],
        }
    ]
    reply = await client.post("/v1/chat/completions", json=chat_body(messages, seed=3, temperature=0.8))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    prompt, gen, lps = vllm_model_token_fields(body)
    assert prompt == tiny_gen.codec.render(chat_to_messages(messages), TOOLS).prompt_token_ids
    assert len(gen) == len(lps) == body["usage"]["completion_tokens"] > 0
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    assert choice["message"]["role"] == "assistant" and "content" in choice["message"]


async def test_replayed_turn_is_spliced_exactly(client: httpx.AsyncClient) -> None:
    first = [{"role": "user", "content": "count to three"}]
    b1 = (await client.post("/v1/chat/completions", json=chat_body(first, seed=1))).json()
    p1, g1, l1 = vllm_model_token_fields(b1)
    msg = b1["choices"][0]["message"]
    # vllm_model replays the assistant message with the token fields, reasoning split out
    replay = [
        *first,
        {
            "role": "assistant",
            "content": (msg["content"] or "") + "  (edited)",
            "prompt_token_ids": p1,
            "generation_token_ids": g1,
            "generation_log_probs": l1,
        },
        {"role": "user", "content": "again"},
    ]
    b2 = (await client.post("/v1/chat/completions", json=chat_body(replay, seed=2))).json()
    p2, _, _ = vllm_model_token_fields(b2)
    assert p2[: len(p1) + len(g1)] == p1 + g1


async def test_tokenize_matches_the_generation_prompt(client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "tokenize me"}]
    tok = (
        await client.post("/tokenize", json={"model": "tiny", "messages": messages, "tools": TOOLS})
    ).json()
    body = (await client.post("/v1/chat/completions", json=chat_body(messages))).json()
    assert tok["tokens"] == body["prompt_token_ids"] and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 600


async def test_responses_endpoint_puts_token_fields_on_the_last_item(client: httpx.AsyncClient) -> None:
    body = {
        "model": "tiny",
        "input": "hello there",
        "tools": RESPONSES_TOOLS,
        "max_output_tokens": 3,
        "temperature": 1.0,
    }
    reply = (await client.post("/v1/responses", json=body)).json()
    out = reply["output"]
    assert out and all("generation_token_ids" not in o for o in out[:-1])
    last = out[-1]
    assert len(last["generation_token_ids"]) == len(last["generation_log_probs"]) > 0
    assert last["prompt_token_ids"]
    if reply["status"] == "incomplete":
        assert reply["incomplete_details"] == {"reason": "max_output_tokens"}
        assert len(last["generation_token_ids"]) == 3
    for key in ("id", "created_at", "model", "object", "parallel_tool_calls", "tool_choice", "tools"):
        assert key in reply


async def test_context_overflow_like_vllm(client: httpx.AsyncClient) -> None:
    long_text = "one two three four five " * 200
    chat = await client.post("/v1/chat/completions", json=chat_body([{"role": "user", "content": long_text}]))
    assert chat.status_code == 400
    assert "maximum context length is 600 tokens" in chat.json()["message"]  # what vllm_model matches on
    resp = await client.post("/v1/responses", json={"model": "tiny", "input": long_text})
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "incomplete" and body["output"] == []
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize(
    ("path", "payload", "status", "needle"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "n": 2},
            400,
            "n must be 1",
        ),
        ("/v1/chat/completions", {"messages": []}, 400, "non-empty"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            400,
            "temperature",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream": True},
            400,
            "stream",
        ),
        ("/v1/responses", {"input": [{"type": "compaction", "blob": "?"}]}, 400, "compaction"),
        (
            "/v1/responses",
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "file:///etc/passwd"}]}
                ]
            },
            400,
            "media",
        ),
        ("/v1/nothing", {}, 404, "no route"),
    ],
)
async def test_bad_requests_get_json_4xx(
    client: httpx.AsyncClient, path: str, payload: Any, status: int, needle: str
) -> None:
    reply = await client.post(path, json=payload)
    assert reply.status_code == status
    body = reply.json()
    assert body["object"] == "error" and body["code"] == status and needle in body["message"]


async def test_invalid_json_and_health(client: httpx.AsyncClient) -> None:
    bad = await client.post(
        "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["message"]
    for path in ("/", "/health", "/ng-rollout/abc/healthz"):
        assert (await client.get(path)).json() == {"status": "ok"}
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 600


async def test_concurrent_requests_are_batched(client: httpx.AsyncClient, server: ModelServer) -> None:
    assert isinstance(server.generator, BatchingGenerator)
    before = server.generator.batches_run
    body = chat_body([{"role": "user", "content": "same"}], max_tokens=4)
    replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(8)))
    assert all(r.status_code == 200 for r in replies)
    batches = server.generator.batches_run - before
    assert batches < 8, f"8 concurrent requests ran as {batches} batches"


def test_cli_serves_the_tiny_model(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gymbridge.generation.cli",
            "serve",
            "--tiny",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--default-max-tokens",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("serving on http://127.0.0.1:"), line
        url = line.split()[2]
        reply = httpx.post(
            f"{url}/v1/chat/completions", json=chat_body([{"role": "user", "content": "hi"}]), timeout=60
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 4
        assert json.loads(httpx.get(f"{url}/v1/models").text)["data"][0]["id"].startswith("gymbridge-tiny")
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_model_group_plugs_into_the_cli_dispatch_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gymbridge model serve`` = one COMMAND_GROUPS entry pointing at add_model_commands."""
    from gymbridge import cli
    from gymbridge.generation import cli as model_cli

    entry = ("model server: serve a generator over HTTP", "gymbridge.generation.cli:add_model_commands")
    monkeypatch.setitem(cli.COMMAND_GROUPS, "model", entry)
    args = cli.build_parser(["model"]).parse_args(["model", "serve", "--tiny", "--port", "0"])
    assert args.func is model_cli._cmd_serve and args.tiny and args.port == 0
    with pytest.raises(SystemExit):
        cli.build_parser(["model"]).parse_args(["model", "serve", "--tiny", "--model", "x"])
