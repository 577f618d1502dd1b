"""The model server's own counters (``ModelServer.counters()``, ``GET /counters``): generation
compute, request time, preparation and token counts, every value monotone."""

from __future__ import annotations

import asyncio

import httpx

from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.server import ModelServer, ModelServerConfig


async def test_counters_count_every_request_and_token_and_only_grow(tiny_gen: HFGenerator) -> None:
    config = ModelServerConfig(
        model_name="tiny", max_model_len=600, default_max_tokens=4, batch_window_s=0.02
    )
    async with ModelServer(tiny_gen, config=config) as server, httpx.AsyncClient(timeout=60) as http:
        start = (await http.get(f"{server.url}/counters")).json()
        assert start == server.counters() == {}  # nothing ran yet

        async def ask(text: str) -> dict[str, object]:
            body = {"input": text, "temperature": 0.0, "max_output_tokens": 4}
            reply = await http.post(f"{server.url}/v1/responses", json=body)
            assert reply.status_code == 200, reply.text
            out: dict[str, object] = reply.json()
            return out

        answers = await asyncio.gather(*(ask(f"say {i}") for i in range(6)))
        first = (await http.get(f"{server.url}/counters")).json()
        generated = sum(a["usage"]["output_tokens"] for a in answers)  # type: ignore[index]
        prompts = sum(a["usage"]["input_tokens"] for a in answers)  # type: ignore[index]
        assert first["generated_tokens"] == generated and first["prompt_tokens"] == prompts
        assert first["generate_n"] == 6 and first["prepare_n"] == 6
        assert 1 <= first["compute_n"] <= 6  # concurrent requests share batched calls
        assert 0 < first["compute_busy_s"] <= first["compute_s"]
        assert first["compute_busy_s"] <= first["generate_busy_s"] + 1e-6
        await ask("once more")
        second = server.counters()
        assert set(first) <= set(second)
        assert all(second[k] >= first[k] for k in first)
        assert second["generate_n"] == 7


async def test_an_unbatched_server_counts_compute_per_request(tiny_gen: HFGenerator) -> None:
    config = ModelServerConfig(model_name="tiny", max_model_len=600, default_max_tokens=3, batching=False)
    async with ModelServer(tiny_gen, config=config) as server, httpx.AsyncClient(timeout=60) as http:
        body = {"input": "hi", "temperature": 0.0, "max_output_tokens": 3}
        for _ in range(2):
            assert (await http.post(f"{server.url}/v1/responses", json=body)).status_code == 200
        counters = server.counters()
        assert counters["compute_n"] == counters["generate_n"] == 2
