"""The model server's media cache: a group's image fetched, decoded and processed once per server."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from aiohttp import web
from PIL import Image

import gymbridge.media.decode as media_decode
import gymbridge.tensors.processor as tensor_processor
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.server import ModelServer, ModelServerConfig
from gymbridge.media import MediaPolicy
from gymbridge.media.cache import MediaCache
from gymbridge.media.hashing import content_key
from gymbridge.media.refs import encode_data_url
from gymbridge.media.store import MediaServer, MediaStore

pytestmark = pytest.mark.integration


def photo_png(seed: int, size: int = 56) -> bytes:
    """Incompressible pixels (a photo-like image), as PNG."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def request(url: str, *, seed: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input": [
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": url, "detail": "auto"},
                    {"type": "input_text", "text": "what is shown?"},
                ],
            }
        ],
        "max_output_tokens": 4,
    }
    if seed is not None:
        body |= {"temperature": 1.0, "seed": seed}
    return body


def tokens(body: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    last = body["output"][-1]
    return last["prompt_token_ids"], last["generation_token_ids"], last["generation_log_probs"]


@pytest.fixture
def media(tmp_path: Path) -> Iterator[MediaServer]:
    with MediaServer(MediaStore(tmp_path / "media")) as server:
        yield server


class Counter:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decodes = 0
        self.processed = 0
        decode, process = media_decode.decode_image, tensor_processor.process_decoded

        def counting_decode(*args: Any, **kwargs: Any) -> Any:
            self.decodes += 1
            return decode(*args, **kwargs)

        def counting_process(*args: Any, **kwargs: Any) -> Any:
            self.processed += 1
            return process(*args, **kwargs)

        monkeypatch.setattr(media_decode, "decode_image", counting_decode)
        monkeypatch.setattr(tensor_processor, "process_decoded", counting_process)

    def reset(self) -> None:
        self.decodes = self.processed = 0


async def _serve(gen: HFGenerator, media: MediaServer | None, **config: Any) -> ModelServer:
    policy = MediaPolicy(media_hosts=(media.host_entry,)) if media is not None else MediaPolicy()
    server = ModelServer(
        gen,
        config=ModelServerConfig(model_name="tiny", max_model_len=600, default_max_tokens=4, **config),
        media_policy=policy,
    )
    await server.start()
    return server


async def test_group_sharing_one_image_is_fetched_decoded_and_processed_once(
    tiny_gen: HFGenerator, media: MediaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = Counter(monkeypatch)
    server = await _serve(tiny_gen, media)
    try:
        async with httpx.AsyncClient(base_url=str(server.url), timeout=120) as client:
            # a first image: the codec checks its by-count placeholder expansion once
            warm = media.url_for(media.store.put(photo_png(0)))
            assert (await client.post("/v1/responses", json=request(warm))).status_code == 200
            counter.reset()
            served = media.requests_served
            url = media.url_for(media.store.put(photo_png(1)))
            group = 8
            replies = await asyncio.gather(
                *(client.post("/v1/responses", json=request(url)) for _ in range(group))
            )
            assert [r.status_code for r in replies] == [200] * group
            assert media.requests_served - served == 1  # fetched once
            assert counter.decodes == 1  # decoded once
            assert counter.processed == 1  # processed once (placeholders and forward alike)
            prompts = {tuple(tokens(r.json())[0]) for r in replies}
            assert len(prompts) == 1
            stats = (await client.get("/media_cache")).json()
            assert stats["kinds"]["fetched:image"]["misses"] == 2  # warm-up + the group's image
            assert stats["kinds"]["fetched:image"]["hits"] == group - 1
            assert stats["kinds"]["processed:image"]["misses"] == 2
            assert stats["bytes"] > 0 and stats["bytes"] <= stats["max_bytes"]
    finally:
        await server.stop()


async def test_reference_inline_and_uncached_give_identical_tokens_and_logprobs(
    tiny_gen: HFGenerator, media: MediaServer
) -> None:
    raw = photo_png(2)
    url = media.url_for(media.store.put(raw))
    inline = encode_data_url(raw, "image/png")
    answers = []
    for cache_bytes in (512 * 2**20, 0):
        server = await _serve(tiny_gen, media, media_cache_bytes=cache_bytes)
        try:
            async with httpx.AsyncClient(base_url=str(server.url), timeout=120) as client:
                for source in (inline, url, url):
                    reply = await client.post("/v1/responses", json=request(source, seed=7))
                    assert reply.status_code == 200, reply.text
                    answers.append(tokens(reply.json()))
        finally:
            await server.stop()
    assert all(a == answers[0] for a in answers)
    assert len(answers[0][1]) == 4


async def test_cache_off_still_processes_every_request(
    tiny_gen: HFGenerator, media: MediaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = Counter(monkeypatch)
    server = await _serve(tiny_gen, media, media_cache_bytes=0)
    try:
        url = media.url_for(media.store.put(photo_png(3)))
        async with httpx.AsyncClient(base_url=str(server.url), timeout=120) as client:
            served = media.requests_served
            for _ in range(3):
                assert (await client.post("/v1/responses", json=request(url))).status_code == 200
        assert media.requests_served - served == 3
        assert counter.decodes >= 3
    finally:
        await server.stop()


async def test_reference_whose_bytes_do_not_hash_to_the_key_is_refused(tiny_gen: HFGenerator) -> None:
    good, evil = photo_png(4), photo_png(5)
    key = content_key(good)

    async def lying(_request: web.Request) -> web.Response:
        return web.Response(body=evil, content_type="image/png")

    app = web.Application()
    app.router.add_get(f"/media/{key}", lying)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    policy = MediaPolicy(media_hosts=(f"127.0.0.1:{port}",))
    server = ModelServer(
        tiny_gen, config=ModelServerConfig(model_name="tiny", max_model_len=600), media_policy=policy
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=str(server.url), timeout=60) as client:
            url = f"http://127.0.0.1:{port}/media/{key}"
            for _ in range(2):  # refused every time: nothing wrong was cached
                reply = await client.post("/v1/responses", json=request(url))
                assert reply.status_code == 400
                assert key in reply.json()["message"] or "sha256" in reply.json()["message"]
            assert server.media_cache.stats()["entries"] == 0
    finally:
        await server.stop()
        await runner.cleanup()


def test_media_cache_evicts_least_recently_used_within_its_byte_bound() -> None:
    cache = MediaCache(max_bytes=300)
    for name in ("a", "b", "c"):
        cache.get_or_make("raw", name, lambda: b"x" * 100)
    cache.get_or_make("raw", "a", lambda: b"never")  # a hit: "a" is now the most recent
    cache.get_or_make("raw", "d", lambda: b"y" * 100)  # evicts "b", the least recent
    assert cache.get_or_make("raw", "a", lambda: b"new") == b"x" * 100
    assert cache.get_or_make("raw", "b", lambda: b"again") == b"again"
    stats = cache.stats()
    assert stats["bytes"] <= 300
    assert stats["kinds"]["raw"]["evictions"] >= 1
    assert cache.get_or_make("raw", "huge", lambda: b"z" * 1000) == b"z" * 1000  # returned, not kept
    assert cache.stats()["bytes"] <= 300


def test_media_cache_computes_a_missing_entry_once_for_concurrent_callers() -> None:
    cache = MediaCache(max_bytes=10_000)
    calls = 0
    lock = threading.Lock()

    def slow() -> bytes:
        nonlocal calls
        with lock:
            calls += 1
        time.sleep(0.2)
        return b"v" * 10

    results: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.get_or_make("k", "1", slow))) for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == 1 and results == [b"v" * 10] * 6


def test_media_cache_does_not_keep_a_failure() -> None:
    cache = MediaCache(max_bytes=10_000)

    def boom() -> bytes:
        raise ValueError("broken")

    with pytest.raises(ValueError, match="broken"):
        cache.get_or_make("k", "1", boom)
    assert cache.get_or_make("k", "1", lambda: b"ok") == b"ok"


def test_model_server_cli_takes_the_cache_bound_and_media_hosts() -> None:
    import argparse

    from gymbridge.generation.cli import add_model_commands

    parser = argparse.ArgumentParser()
    add_model_commands(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "--tiny", "--media-cache-bytes", "1048576", "--media-host", "127.0.0.1:9000"]
    )
    assert args.media_cache_bytes == 1048576 and args.media_host == ["127.0.0.1:9000"]
