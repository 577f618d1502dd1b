"""Model-server overhead per request vs calling the generator directly (tiny model).

For each concurrency level C, the same N requests (one user message with an image,
``max_tokens`` new tokens, fixed seeds) run two ways in one process:

* **direct** — C tasks call ``BatchingGenerator(HFGenerator.tiny()).generate`` with a
  prompt rendered once up front (what a trainer calling the generator pays);
* **server** — C httpx clients POST ``/v1/chat/completions`` (the body genuine
  ``vllm_model`` sends) to ``ModelServer`` on loopback (templating, media loading,
  JSON, HTTP, batching included).

The tiny model makes generation cheap, so the server's own cost shows. Both paths
batch the same way; overhead = (server - direct) wall time / N. Ratios are measured
in one run (these machines are noisy). Not part of the test suite.

    .venv/bin/python benchmarks/model_server_bench.py [--requests 64] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import time
from typing import Any

import httpx
from PIL import Image

from gymbridge.generation.batching import BatchingGenerator
from gymbridge.generation.chat import chat_to_messages
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.outputs import generation_input_from_prompt
from gymbridge.generation.server import ModelServer, ModelServerConfig
from gymbridge.generation.types import SamplingConfig
from gymbridge.media import encode_data_url


def image_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (112, 84), (200, 40, 40)).save(buf, "PNG")
    return encode_data_url(buf.getvalue(), "image/png")


def messages() -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_url(), "detail": "auto"}},
                {"type": "text", "text": "What color is the square?"},
            ],
        }
    ]


async def run_direct(gen: HFGenerator, n: int, conc: int, max_tokens: int) -> float:
    rendered = gen.codec.render(chat_to_messages(messages()))
    inp = generation_input_from_prompt(rendered.prompt_token_ids, rendered.media)
    batched = BatchingGenerator(gen, max_batch_size=64, window_s=0.002)
    sem = asyncio.Semaphore(conc)

    async def one(i: int) -> None:
        async with sem:
            await batched.generate([inp], SamplingConfig(max_tokens=max_tokens, seed=0))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - t0
    await batched.aclose()
    return elapsed


async def run_server(url: str, n: int, conc: int, max_tokens: int) -> float:
    sem = asyncio.Semaphore(conc)
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def one(i: int) -> None:
            body = {
                "model": "tiny",
                "messages": messages(),
                "max_tokens": max_tokens,
                "seed": 0,
                "logprobs": True,
                "top_logprobs": 0,
                "return_tokens_as_token_ids": True,
            }
            async with sem:
                reply = await client.post("/v1/chat/completions", json=body)
                reply.raise_for_status()

        await one(0)  # warm the connection pool
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - t0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=3, help="median of this many runs per cell")
    args = parser.parse_args()

    gen = HFGenerator.tiny(0)
    config = ModelServerConfig(model_name="tiny", max_model_len=4096, max_batch_size=64)
    server = ModelServer(gen, config=config)
    url = await server.start()
    await run_direct(gen, 4, 1, args.max_tokens)  # warm-up
    print(f"tiny Qwen2-VL, {args.requests} requests x {args.max_tokens} new tokens, 1 image each (CPU)")
    print(f"{'conc':>5} {'direct ms/req':>14} {'server ms/req':>14} {'overhead ms/req':>16} {'ratio':>6}")
    for conc in args.concurrency:
        direct = statistics.median(
            [await run_direct(gen, args.requests, conc, args.max_tokens) for _ in range(args.repeats)]
        )
        served = statistics.median(
            [await run_server(url, args.requests, conc, args.max_tokens) for _ in range(args.repeats)]
        )
        d, s = 1000 * direct / args.requests, 1000 * served / args.requests
        print(f"{conc:>5} {d:>14.2f} {s:>14.2f} {s - d:>16.2f} {s / d:>6.2f}")
    await server.stop()


if __name__ == "__main__":
    asyncio.run(main())
