"""A model server with weight updates on, on an event loop in a thread of its own: what the tests and
benchmarks of weight publication talk to (the publishers are synchronous; the server is asyncio)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["TESTING_WEIGHTS_SECRET", "served_in_thread"]

TESTING_WEIGHTS_SECRET = "gymbridge-testing-weights-secret"
"""The run secret :func:`served_in_thread` guards its weight routes with by default (tests and
benchmarks on loopback; a real run makes a fresh one)."""


@contextmanager
def served_in_thread(
    generator: Any, sink: Any, *, timeout_s: float = 60.0, weights_secret: str = TESTING_WEIGHTS_SECRET
) -> Iterator[str]:
    """Serve ``generator`` with ``sink`` as its weight sink (the routes ``gymbridge model serve
    --enable-weight-updates`` opens, guarded by ``weights_secret``: give the publisher the same
    ``secret``) on a free loopback port; yields the base URL and stops the server on the way out."""
    from gymbridge.generation.server import ModelServer, ModelServerConfig

    ready = threading.Event()
    urls: list[str] = []
    stop: list[asyncio.Event] = []

    async def serve() -> None:
        server = ModelServer(
            generator,
            config=ModelServerConfig(batching=False),
            weight_sink=sink,
            weights_secret=weights_secret,
        )
        urls.append(await server.start())
        stop.append(asyncio.Event())
        ready.set()
        await stop[0].wait()
        await server.stop()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    if not ready.wait(timeout_s):
        raise TimeoutError(f"the model server did not start in {timeout_s:g}s")
    try:
        yield urls[0]
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(timeout_s)
