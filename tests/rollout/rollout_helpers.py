"""Helpers for the native-rollout tests."""

from __future__ import annotations

import json
from typing import Any

from gymbridge.generation.hf import HFGenerator


def zoom_call_tokens(gen: HFGenerator, bbox: list[int]) -> list[int]:
    """The tokens of a well-formed Hermes zoom call, ended by the end-of-turn token."""
    text = "<tool_call>\n" + json.dumps({"name": "zoom", "arguments": {"bbox": bbox}}) + "\n</tool_call>"
    ids = gen.tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids] + [gen.codec.end_of_turn_id]


async def run_via_model_server(
    generator: Any, env_url: str, row: dict[str, Any], *, max_steps: int, max_model_len: int
) -> dict[str, Any]:
    """One ``/run``: gymbridge's SimpleAgent -> a ModelServer over ``generator`` (T=0.8, 12 tokens)."""
    import httpx

    from gymbridge.generation.server import ModelServer, ModelServerConfig
    from gymbridge.server import SimpleAgent, start_server

    config = ModelServerConfig(model_name="tiny", max_model_len=max_model_len, batching=False)
    row = {
        **row,
        "responses_create_params": {
            **row["responses_create_params"],
            "temperature": 0.8,
            "max_output_tokens": 12,
        },
    }
    async with ModelServer(generator, config=config) as server:
        agent = SimpleAgent(resources_url=env_url, model_url=str(server.url), max_steps=max_steps)
        async with await start_server(agent) as running, httpx.AsyncClient(timeout=120) as client:
            reply = await client.post(f"{running.url}/run", json=row)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result
