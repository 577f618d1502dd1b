"""``BatchingGenerator``: gathers concurrent single requests into batched ``generate`` calls.

The model server and concurrent native rollouts each ask for one generation at a
time; a transformers model is far cheaper per row when rows share a forward pass.
This wrapper queues requests, waits up to ``window_s`` after the first one for
more, groups the queued requests by their (hashable) :class:`SamplingConfig` and
hands each group to the wrapped generator as one call. Seeded calls are merged only
into a backend that samples every row from its own stream
(:class:`~gymbridge.generation.types.RowSeededGenerator`: HF, vLLM): each row then goes with
its own seed (``row_seed(seed, j)`` for row ``j`` of its call) and gets the answer it would
get alone. Into any other backend (which seeds a whole batch, so a seeded row's sample
would depend on its batch-mates) a seeded call runs as the batch it was asked as.

Invariants: every request gets exactly its own result or its own exception (a
failing batch is retried row by row, so one bad row cannot fail its neighbours);
results keep request order within a group; a failing group does not affect other
groups; ``codec``, ``max_model_len`` and ``model_name`` of the wrapped generator are
exposed and ``policy_version`` is the wrapped generator's (read and written through), so
a wrapped generator serves wherever the bare one does; the worker task
starts lazily on the running loop and stops with :meth:`aclose`, which cancels every
request still waiting (queued or in flight), so no caller awaits a future nobody resolves.

A backend that batches concurrent calls itself (vLLM's continuous batching) sets
``continuous_batching = True``; wrapping it would hold every new request until the
slowest of the current batch finishes, so :func:`needs_batching` says not to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gymbridge.generation.types import (
    Generation,
    Generator,
    SamplingConfig,
    row_seed,
    row_seeded,
    wrapped_policy_version,
)
from gymbridge.trajectory.types import GenerationInput

if TYPE_CHECKING:
    from gymbridge.metrics.timing import PhaseTimer

logger = logging.getLogger(__name__)

__all__ = ["BatchingGenerator", "needs_batching"]


def needs_batching(generator: Generator) -> bool:
    """Whether ``generator`` gains from a :class:`BatchingGenerator` in front of it.

    False for one already batching and for a backend that batches concurrent calls itself
    (``continuous_batching = True``, e.g. vLLM).
    """
    return not (isinstance(generator, BatchingGenerator) or getattr(generator, "continuous_batching", False))


@dataclass(slots=True)
class _Pending:
    inp: GenerationInput
    sampling: SamplingConfig
    future: asyncio.Future[Generation]
    call: int = 0
    """Which ``generate`` call queued it: seeded calls are grouped per call, never merged
    (unless the backend is row-seeded)."""
    row: int = 0
    """Its index in that call: its row seed is ``row_seed(seed, row)``."""


class BatchingGenerator:
    """Wrap ``inner``; ``generate`` calls from many tasks share batched calls to ``inner``.

    ``timer``: each batched call to ``inner`` is one interval of its ``compute`` phase (the
    generator's own time, queueing excluded).
    """

    def __init__(
        self,
        inner: Generator,
        *,
        max_batch_size: int = 64,
        window_s: float = 0.002,
        timer: PhaseTimer | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.inner = inner
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self.timer = timer
        self._generate_rows = inner.generate_rows if row_seeded(inner) else None
        """Set when the inner generator samples each row from its own stream: seeded requests merge."""
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_flight: list[_Pending] = []
        self.batches_run = 0
        self.rows_run = 0
        self._calls = 0
        # what the model server and native rollouts read off a generator: the inner one's
        for attr in ("codec", "max_model_len", "model_name"):
            if hasattr(inner, attr):
                setattr(self, attr, getattr(inner, attr))

    policy_version = wrapped_policy_version("inner")

    def _ensure_worker(self) -> asyncio.Queue[_Pending]:
        loop = asyncio.get_running_loop()
        if self._queue is None or self._worker is None or self._worker.done() or self._loop is not loop:
            # (re)start on this loop: a worker of a closed loop would never answer
            self._queue = asyncio.Queue()
            self._worker = loop.create_task(self._run(self._queue))
            self._loop = loop
        return self._queue

    async def generate(self, inputs: Sequence[GenerationInput], sampling: SamplingConfig) -> list[Generation]:
        queue = self._ensure_worker()
        loop = asyncio.get_running_loop()
        self._calls += 1
        pending = [
            _Pending(inp, sampling, loop.create_future(), self._calls, j) for j, inp in enumerate(inputs)
        ]
        for p in pending:
            queue.put_nowait(p)
        return list(await asyncio.gather(*(p.future for p in pending)))

    async def _run(self, queue: asyncio.Queue[_Pending]) -> None:
        while True:
            batch = [await queue.get()]
            self._in_flight = batch  # taken off the queue: aclose must still find these
            deadline = asyncio.get_running_loop().time() + self.window_s
            while len(batch) < self.max_batch_size:
                timeout = deadline - asyncio.get_running_loop().time()
                if timeout <= 0:
                    while not queue.empty() and len(batch) < self.max_batch_size:
                        batch.append(queue.get_nowait())
                    break
                try:
                    batch.append(await asyncio.wait_for(queue.get(), timeout))
                except TimeoutError:
                    break
            groups: dict[tuple[SamplingConfig, int], list[_Pending]] = {}
            for p in batch:
                if not p.future.cancelled():
                    # a row-seeded backend: every row carries its own seed, seeded or not they share a call
                    if self._generate_rows is not None:
                        key = (replace(p.sampling, seed=None), 0)
                    else:
                        key = (p.sampling, p.call if p.sampling.seed is not None else 0)
                    groups.setdefault(key, []).append(p)
            for (sampling, _), group in groups.items():
                await self._run_group(sampling, group)

    async def _run_group(self, sampling: SamplingConfig, group: list[_Pending]) -> None:
        try:
            token = self.timer.start("compute") if self.timer is not None else 0
            try:
                if self._generate_rows is not None:
                    seeds = [
                        None if p.sampling.seed is None else row_seed(p.sampling.seed, p.row) for p in group
                    ]
                    results = await self._generate_rows([p.inp for p in group], sampling, seeds)
                else:
                    results = await self.inner.generate([p.inp for p in group], sampling)
            finally:
                if self.timer is not None:
                    self.timer.stop(token)
            if len(results) != len(group):
                raise RuntimeError(f"generator returned {len(results)} results for {len(group)} inputs")
        except Exception as exc:  # every waiter must learn of the failure
            if len(group) > 1:
                # One bad row must not fail its neighbours: retry them one by one.
                logger.warning("batched generate failed (%s); retrying %d rows singly", exc, len(group))
                for p in group:
                    await self._run_group(sampling, [p])
                return
            for p in group:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        self.batches_run += 1
        self.rows_run += len(group)
        for p, r in zip(group, results, strict=True):
            if not p.future.done():
                p.future.set_result(r)

    async def aclose(self) -> None:
        """Stop the worker task; every request still waiting (queued or in flight) is cancelled."""
        if self._worker is not None and self._loop is asyncio.get_running_loop():
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        stranded = list(self._in_flight)
        if self._queue is not None:
            while not self._queue.empty():
                stranded.append(self._queue.get_nowait())
        for p in stranded:
            if not p.future.done():
                p.future.cancel()
        self._in_flight = []
        self._queue = None
        self._worker = None
