"""Model-server hardening figures (docs/security.md): refusal cost, starvation, memory with large images.

    .venv/bin/python benchmarks/model_server_hardening.py

Prints one table. Every row is measured in this run on the tiny offline VLM:

* tokenizing a 10 MB prompt the way the server did before it refused over-long prompts
  (``codec.render``), and the server's refusal of the same prompt now;
* a normal request's latency alone, and while eight 4 MB prompts arrive at once;
* peak RSS growth of a fresh server process with six ~49-megapixel JPEGs in flight, with
  the default ``media_threads=2`` and with 6 threads (what the shared default executor
  allowed before: every request decoded at once). Each configuration runs in its own
  process, so freed memory of one cannot hide the other's peak.
"""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import threading
import time
from typing import Any

import httpx


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRss:
    """Samples this process's RSS every 5 ms in a thread; ``peak`` is the highest seen."""

    def __init__(self) -> None:
        self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.005)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": [{"role": "user", "content": text}], "max_output_tokens": 2, **extra}


def image_body(url: str) -> dict[str, Any]:
    content = [{"type": "input_text", "text": "describe"}, {"type": "input_image", "image_url": url}]
    return {"model": "tiny", "input": [{"role": "user", "content": content}], "max_output_tokens": 2}


def big_jpeg_url(width: int = 7000, height: int = 7000) -> str:
    import numpy as np
    from PIL import Image

    from gymbridge.media import encode_data_url

    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([(x * 255 // width), (y * 255 // height), ((x + y) % 256)], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=85)
    return encode_data_url(buf.getvalue(), "image/jpeg")


async def memory_case(media_threads: int) -> dict[str, float]:
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.generation.server import ModelServer, ModelServerConfig

    gen = HFGenerator.tiny(0)
    url = big_jpeg_url()
    config = ModelServerConfig(model_name="tiny", max_model_len=4096, media_threads=media_threads)
    async with (
        ModelServer(gen, config=config) as srv,
        httpx.AsyncClient(base_url=str(srv.url), timeout=600) as c,
    ):
        await c.post("/v1/responses", json=body("warm up"))
        payload = json.dumps(image_body(url)).encode()
        base = _rss_bytes()
        started = time.perf_counter()
        with PeakRss() as rss:
            replies = await asyncio.gather(*(c.post("/v1/responses", content=payload) for _ in range(6)))
        elapsed = time.perf_counter() - started
    assert all(r.status_code == 200 for r in replies), [r.text[:200] for r in replies]
    return {"peak_growth_mb": (rss.peak - base) / 2**20, "elapsed_s": elapsed}


async def latency_rows() -> list[tuple[str, str]]:
    from gymbridge.generation.chat import ChatMessage
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.generation.server import ModelServer, ModelServerConfig

    gen = HFGenerator.tiny(0)
    rows: list[tuple[str, str]] = []
    ten_mb = "word " * (2 * 1024 * 1024)
    started = time.perf_counter()
    gen.codec.render([ChatMessage(role="user", parts=[ten_mb])], [])
    rows.append(
        (
            "10 MB prompt: codec.render (tokenize in full; the old path)",
            f"{time.perf_counter() - started:.2f} s",
        )
    )
    config = ModelServerConfig(model_name="tiny", max_model_len=4096)
    async with (
        ModelServer(gen, config=config) as srv,
        httpx.AsyncClient(base_url=str(srv.url), timeout=600) as c,
    ):
        await c.post("/v1/responses", json=body("warm up"))
        started = time.perf_counter()
        r = await c.post("/v1/responses", json=body(ten_mb))
        rows.append(
            (
                "10 MB prompt: refused by the server (HTTP round trip)",
                f"{time.perf_counter() - started:.3f} s",
            )
        )
        assert r.json()["status"] == "incomplete"
        normal = body("hello there")
        samples = []
        for _ in range(3):
            started = time.perf_counter()
            await c.post("/v1/responses", json=normal)
            samples.append(time.perf_counter() - started)
        alone = sorted(samples)[1]
        huge = json.dumps(body("word " * (800 * 1024))).encode()
        flood = [asyncio.ensure_future(c.post("/v1/responses", content=huge)) for _ in range(8)]
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        await c.post("/v1/responses", json=normal)
        during = time.perf_counter() - started
        await asyncio.gather(*flood)
    rows.append(("normal request alone (median of 3)", f"{alone:.3f} s"))
    rows.append(("normal request while 8 x 4 MB prompts arrive", f"{during:.3f} s"))
    return rows


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--memory":
        print(json.dumps(asyncio.run(memory_case(int(sys.argv[2])))))
        return
    rows = asyncio.run(latency_rows())
    for threads in (2, 6):
        out = subprocess.run(
            [sys.executable, __file__, "--memory", str(threads)], capture_output=True, text=True, check=True
        )
        res = json.loads(out.stdout.strip().splitlines()[-1])
        label = "default" if threads == 2 else "all at once, as before"
        rows.append(
            (
                f"6 x 49 MP JPEG in flight, media_threads={threads} ({label}): peak RSS growth",
                f"{res['peak_growth_mb']:.0f} MiB ({res['elapsed_s']:.1f} s)",
            )
        )
    width = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
