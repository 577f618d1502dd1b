"""The model server reports the policy version of each generation on both endpoints."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.server import ModelServer, ModelServerConfig


@pytest.fixture
def versioned(tiny_gen: HFGenerator) -> Iterator[HFGenerator]:
    tiny_gen.policy_version = 5
    try:
        yield tiny_gen
    finally:
        tiny_gen.policy_version = 0  # the session generator is shared


async def test_both_endpoints_carry_the_generators_policy_version(versioned: HFGenerator) -> None:
    config = ModelServerConfig(model_name="tiny", max_model_len=512, default_max_tokens=3)
    async with ModelServer(versioned, config=config) as server, httpx.AsyncClient(timeout=60) as client:
        chat = await client.post(
            f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        responses = await client.post(f"{server.url}/v1/responses", json={"input": "hi"})
    assert chat.status_code == 200 and responses.status_code == 200
    assert chat.json()["policy_version"] == 5
    output = responses.json()["output"]
    assert output[-1]["policy_version"] == 5
    assert all("policy_version" not in item for item in output[:-1])  # the last item only
