"""ScriptedModelServer: stock model-server shapes, token fields, contiguous prompts, subprocess entry."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp

from gymbridge.server import free_port
from gymbridge.testing.scripted_model import IMAGE_TOKEN_ID, ScriptedModelServer, call_index

TOKEN_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def test_token_fields_on_last_item_and_prompts_extend() -> None:
    script = [
        {"reasoning": "plan", "calls": [{"name": "click", "arguments": {"x": 1, "y": 2}}]},
        {"reasoning": "more", "text": "final"},
    ]
    async with ScriptedModelServer(script) as model:
        items: list[Any] = [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "click the circle"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"},
                ],
            }
        ]
        status, first = await _post(model.url + "/v1/responses", {"input": items, "model": "m"})
        assert status == 200 and first["object"] == "response" and first["status"] == "completed"
        kinds = [o["type"] for o in first["output"]]
        assert kinds == ["reasoning", "function_call"]
        assert not any(k in first["output"][0] for k in TOKEN_KEYS)
        last = first["output"][-1]
        assert json.loads(last["arguments"]) == {"x": 1, "y": 2}
        assert len(last["generation_token_ids"]) == len(last["generation_log_probs"]) > 0
        assert last["prompt_token_ids"].count(IMAGE_TOKEN_ID) == 1

        items = [
            *items,
            *first["output"],
            {"type": "function_call_output", "call_id": last["call_id"], "output": "ok"},
        ]
        status, second = await _post(model.url + "/v1/responses", {"input": items})
        prompt2 = second["output"][-1]["prompt_token_ids"]
        prefix = last["prompt_token_ids"] + last["generation_token_ids"]
        assert prompt2[: len(prefix)] == prefix and len(prompt2) > len(prefix)
        assert [o["type"] for o in second["output"]] == ["reasoning", "message"]
        assert second["output"][-1]["content"][0]["text"] == "final"
        assert call_index({"input": items}) == 1
        assert len(model.requests) == 2


async def test_chat_completions_and_errors() -> None:
    script = [{"calls": [{"name": "f", "arguments": "{not json"}]}, {"status": 500, "body": "engine died"}]
    async with ScriptedModelServer(script) as model:
        status, body = await _post(
            model.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 200
        message = body["choices"][0]["message"]
        assert body["choices"][0]["finish_reason"] == "tool_calls"
        assert message["tool_calls"][0]["function"]["arguments"] == "{not json"
        assert len(message["generation_token_ids"]) == len(message["generation_log_probs"])
        messages = [{"role": "user", "content": "hi"}, message]
        status, body = await _post(model.url + "/v1/chat/completions", {"messages": messages})
        assert (status, body) == (500, "engine died")


async def test_callable_script_and_incomplete() -> None:
    def script(request: dict[str, Any]) -> dict[str, Any]:
        return {"text": f"call {call_index(request)}", "incomplete": True}

    async with ScriptedModelServer(script) as model:
        _, body = await _post(model.url + "/v1/responses", {"input": "hello"})
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "call 0"


async def test_subprocess_entry_point(tmp_path: Path) -> None:
    script_file = tmp_path / "script.json"
    script_file.write_text(json.dumps(["hello from a subprocess"]))
    port = free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - starting a child process is instant
        [
            sys.executable,
            "-m",
            "gymbridge.testing.scripted_model",
            "--port",
            str(port),
            "--script",
            str(script_file),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            for _ in range(100):
                try:
                    async with http.get(url + "/") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.1)
        status, body = await _post(url + "/v1/responses", {"input": "hi"})
        assert status == 200 and body["output"][0]["content"][0]["text"] == "hello from a subprocess"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
