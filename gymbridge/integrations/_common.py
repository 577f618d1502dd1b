"""What the trainer adapters share: imports naming the extra, a rollout as one sequence, a server thread.

* :func:`require` imports an optional trainer package or raises an ``ImportError`` naming the
  gymbridge extra that installs it (``gymbridge[trl]``, ``gymbridge[verl]``);
* :func:`flatten` turns a :class:`~gymbridge.trajectory.Trajectory` into the one-sequence shape both
  TRL (``prompt_ids`` / ``completion_ids`` / ``env_mask``) and verl (``prompt_ids`` /
  ``response_ids`` / ``response_mask``) train on;
* :func:`masked_reason` says whether a result is ``mask_sample`` (never trained by either);
* :class:`ServerThread` serves a gymbridge server (an environment) on loopback from a daemon thread
  with its own event loop, for callers that hold no loop (TRL's environment factory).

Invariants of a :class:`FlatRollout`: ``prompt_ids + response_ids`` is the trajectory's whole token
sequence; ``response_mask`` / ``response_logprobs`` are as long as ``response_ids``, the mask 1
exactly on generated tokens and the logprob 0.0 elsewhere; ``media`` holds every medium of the
trajectory in order and ``media_turns[i]`` the turn whose prompt delta first showed ``media[i]``.
A trajectory that is not one sequence (several segments) is refused with
:class:`~gymbridge.errors.UntrainableRolloutError` (``noncontiguous``), never split or padded.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from collections.abc import Coroutine, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from gymbridge.errors import UntrainableRolloutError

if TYPE_CHECKING:
    from gymbridge.media import MediaItem
    from gymbridge.server import GymServer, RunningServer
    from gymbridge.trajectory import Trajectory

__all__ = ["FlatRollout", "ServerThread", "flatten", "masked_reason", "require", "run_sync"]

T = TypeVar("T")


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module``, or raise an ``ImportError`` naming ``pip install 'gymbridge[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{what} needs {module}, which is not installed (or does not import: {exc}): install the "
            f"extra with `pip install 'gymbridge[{extra}]'`"
        ) from exc


@dataclass(frozen=True)
class FlatRollout:
    """One rollout as one sequence: the first model call's prompt, then everything after it."""

    prompt_ids: list[int]
    """The first model call's whole prompt ``[P]`` (placeholders expanded)."""
    response_ids: list[int]
    """Every token after the prompt ``[R]``: generations, tool answers, observations."""
    response_mask: list[int]
    """``[R]``: 1 on generated tokens, 0 on environment tokens."""
    response_logprobs: list[float]
    """``[R]``: the sampler's logprob on generated tokens, 0.0 on environment tokens."""
    media: list[MediaItem] = field(default_factory=list)
    media_turns: list[int] = field(default_factory=list)
    reward: float = 0.0
    num_model_calls: int = 0


def flatten(trajectory: Trajectory, *, row: int | None = None) -> FlatRollout:
    """The trajectory's one sequence (module docstring); several segments are ``noncontiguous``."""
    if trajectory.num_segments != 1:
        first = next(t for t in trajectory.turns if t.segment == 1)
        raise UntrainableRolloutError(
            f"the token history does not only append: model call {first.index} (output item "
            f"{first.item_index}) was prompted with a history that is not the previous prompt plus "
            "its generation (a re-rendered or truncated conversation), so the rollout is not one "
            "sequence; train it with gymbridge's own trainer (segments) or make the agent keep "
            "its token history",
            reason="noncontiguous",
            row=row,
        )
    turns = trajectory.turns
    ids, mask, logprobs = trajectory.token_ids(), trajectory.loss_mask(), trajectory.logprobs()
    prompt_len = len(turns[0].prompt_token_ids)
    media = [m for t in turns for m in t.media]
    media_turns = [t.index for t in turns for _ in t.media]
    return FlatRollout(
        prompt_ids=ids[:prompt_len],
        response_ids=ids[prompt_len:],
        response_mask=mask[prompt_len:],
        response_logprobs=logprobs[prompt_len:],
        media=media,
        media_turns=media_turns,
        reward=trajectory.reward,
        num_model_calls=len(turns),
    )


def masked_reason(answer: Any) -> str | None:
    """Why a ``/run`` result or ``/verify`` answer is no measurement (``mask_sample: true``), or None.

    NeMo Gym 0.7.0's consumers leave such a sample out of scores and training: an environment fault
    mid-episode (:mod:`gymbridge.faults`) or the environment's own verdict (``judge_failed``).
    """
    if not isinstance(answer, Mapping) or answer.get("mask_sample") is not True:
        return None
    kind = answer.get("failure_kind")
    reason = answer.get("failure_reason")
    return f"{kind or 'mask_sample'}: {reason or 'the environment marked the sample mask_sample'}"


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code, in a fresh loop (a thread when one is running)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: Future[T] = Future()

    def target() -> None:
        try:
            result.set_result(asyncio.run(coro))
        except BaseException as exc:  # handed to the caller's thread
            result.set_exception(exc)

    thread = threading.Thread(target=target, name="gymbridge-run-sync", daemon=True)
    thread.start()
    return result.result()


class ServerThread:
    """A gymbridge server listening on loopback, served by a daemon thread's own event loop.

    ``start()`` returns the URL once the server listens; ``stop()`` (idempotent) closes it and
    ends the thread. Used as a context manager it starts and stops around the block.
    """

    def __init__(self, server: GymServer, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running: RunningServer | None = None

    @property
    def url(self) -> str:
        if self._running is None:
            raise RuntimeError("the server is not running: call start() first")
        return self._running.url

    def start(self, timeout_s: float = 30.0) -> str:
        if self._running is not None:
            return self._running.url
        from gymbridge.server import start_server

        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="gymbridge-env-server", daemon=True)
        thread.start()
        try:
            running = asyncio.run_coroutine_threadsafe(
                start_server(self.server, self.host, self.port), loop
            ).result(timeout_s)
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
            loop.close()
            raise
        self._loop, self._thread, self._running = loop, thread, running
        return running.url

    def stop(self, timeout_s: float = 30.0) -> None:
        loop, thread, running = self._loop, self._thread, self._running
        self._loop = self._thread = self._running = None
        if loop is None or thread is None or running is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(running.stop(), loop).result(timeout_s)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
            loop.close()

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
