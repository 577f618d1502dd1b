"""What every serving process shares, below all of them: ports, bind errors, the serve-until-signal loop.

The environment and agent servers (:mod:`gymbridge.server`), the model server
(:mod:`gymbridge.generation.server`) and the media server (:mod:`gymbridge.media.store`) bind and
report through these, so a taken or out-of-range port reads the same everywhere.

Invariants: a port is an ``int`` in ``0..MAX_PORT`` (0 picks a free one), anything else is a
:class:`~gymbridge.errors.ServeError` before any bind; a failed bind becomes one
:class:`~gymbridge.errors.ServeError` line naming the address and why; nothing is announced
before the port is bound. Standard library only (no aiohttp, no torch).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from gymbridge.errors import ServeError

__all__ = ["MAX_PORT", "bind_error", "check_port", "free_port", "probe_port", "serve_until_stopped"]

MAX_PORT = 65535
"""The largest TCP port number."""


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host`` (racy by nature; prefer ``port=0``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port(port: int) -> int:
    """``port`` when it is a TCP port number (0 = any free port), else :class:`ServeError`."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
        raise ServeError(f"port {port!r} is out of range: give 0..{MAX_PORT} (0 picks a free port)")
    return port


def bind_error(host: str, port: int, exc: OSError) -> ServeError:
    """The :class:`ServeError` for a failed bind of ``host:port``: one line saying why."""
    if exc.errno == errno.EADDRINUSE:
        reason = "the address is already in use (another server is listening there; pick another --port)"
    elif exc.errno == errno.EACCES:
        reason = "permission denied (ports below 1024 need privileges)"
    elif exc.errno == errno.EADDRNOTAVAIL:
        reason = "the address is not available on this machine (check --host)"
    else:
        reason = exc.strerror or str(exc)
    return ServeError(f"cannot listen on {host}:{port}: {reason}", host=host, port=port)


def probe_port(host: str, port: int) -> None:
    """Fail fast, before any slow set-up, when ``host:port`` cannot be bound now (:class:`ServeError`).

    Racy by nature (the real bind decides); it only lets a CLI refuse a taken port before it
    loads a model. Port 0 always passes.
    """
    check_port(port)
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc}", host=host, port=port) from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise bind_error(host, port, exc) from exc


async def serve_until_stopped(
    start: Callable[[], Awaitable[Any]],
    stop: Callable[[], Awaitable[None]],
    announce: Callable[[], None] | None = None,
) -> None:
    """Run ``start()`` (which binds), then ``announce()``, then wait for SIGINT / SIGTERM; then ``stop()``.

    The one serving loop of every CLI server (environment, agent, model): nothing is announced
    before the port is bound, and a failed bind (:class:`ServeError`) propagates with nothing
    printed.
    """
    await start()
    try:
        if announce is not None:
            announce()
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stopped.set)
        await stopped.wait()
    finally:
        await stop()
