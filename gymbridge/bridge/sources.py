"""Rollout sources: where the G rollouts of one prompt come from.

A :class:`RolloutSource` turns one dataset row into ``group_size`` :class:`RolloutRecord` s,
one per rollout, **always exactly** ``group_size`` of them, in rollout-index order: a
rollout that failed is a record with ``failure_class`` / ``failure_reason`` (data, not an
exception). Two sources ship:

* :class:`GymRollouts` — the Gym path: ``POST <agent>/run`` through a
  :class:`~gymbridge.client.GymClient`. ``_ng_task_index`` and ``_ng_rollout_index`` go at
  the row's **top level**; ``responses_create_params`` is sent exactly as the dataset gave
  it (genuine servers answer 422 to unknown keys there);
* :class:`NativeRollouts` — the native path: :func:`~gymbridge.rollout.run_episode` drives a
  :class:`~gymbridge.generation.Generator` and an environment server directly, the G
  rollouts of a prompt concurrent and their model calls batched.

:class:`RoutedRollouts` sends each row to the source of the environment it names (``agent_ref``,
:func:`~gymbridge.client.env_of_row`): several environments in one run on the native path (one
:class:`NativeRollouts` per environment server; the Gym path routes in the
:class:`~gymbridge.client.GymClient` instead).

Both return the ``/run`` result shape, so one postprocessor serves both. Payload metrics
(``prompt_repeat``, ``gym_request``, ``gym_return``) are recorded when a meter is given.

Media by reference (``GymRollouts(referencer=...)``, a :class:`~gymbridge.bridge.RowReferencer`):
the row's inline media are put into the media store once per prompt, before the G rows are
made, so every ``/run`` request carries ~100-byte references instead of base64 copies.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from gymbridge.client import env_of_row
from gymbridge.errors import GymbridgeError
from gymbridge.generation.seeding import rollout_seed

if TYPE_CHECKING:
    from gymbridge.bridge.byref import RowReferencer
    from gymbridge.client import GymClient
    from gymbridge.generation.types import Generator, SamplingConfig
    from gymbridge.media import MediaPolicy
    from gymbridge.metrics import PayloadMeter

logger = logging.getLogger(__name__)

__all__ = [
    "GymRollouts",
    "NativeRollouts",
    "RolloutRecord",
    "RolloutSource",
    "RoutedRollouts",
    "indexed_rows",
    "unmetered",
]

_OWN_CLASSES = ("env_session_lost", "generator_lost")
"""Client failure kinds recorded under their own name (the others as ``gym_<kind>``)."""


@dataclass(frozen=True, slots=True)
class RolloutRecord:
    """One rollout's outcome: a ``/run``-shaped ``result`` or a failure (class + reason)."""

    task_index: int
    rollout_index: int
    result: dict[str, Any] | None = None
    failure_class: str | None = None
    failure_reason: str | None = None
    attempts: int = 0
    elapsed_s: float = 0.0

    def __post_init__(self) -> None:
        if (self.result is None) == (self.failure_class is None):
            raise ValueError("a RolloutRecord is either a result or a failure (class + reason), not both")

    @property
    def ok(self) -> bool:
        return self.result is not None


def _unmetered(source: Any) -> Any:
    """A shallow copy of ``source`` without its payload meter (its client or generator shared)."""
    twin = copy.copy(source)
    twin.meter = None
    return twin


def unmetered(source: RolloutSource) -> RolloutSource:
    """``source`` without payload measurement when it has a meter (its ``unmetered()``), else itself."""
    make = getattr(source, "unmetered", None)
    return make() if callable(make) else source


class RolloutSource(Protocol):
    """Produces the ``group_size`` rollouts of one dataset row (see the module docstring)."""

    async def rollouts(
        self, row: Mapping[str, Any], *, task_index: int, group_size: int
    ) -> list[RolloutRecord]: ...

    async def aclose(self) -> None: ...


def indexed_rows(row: Mapping[str, Any], task_index: int, group_size: int) -> list[dict[str, Any]]:
    """The G copies of ``row`` sent for one prompt: indices at the top level, nothing else changed."""
    return [{**row, "_ng_task_index": task_index, "_ng_rollout_index": i} for i in range(group_size)]


class GymRollouts:
    """The Gym path: every rollout is one ``POST /run`` through ``client`` (deadlines, bounded retries)."""

    def __init__(
        self,
        client: GymClient,
        *,
        deadline_s: float | None = None,
        meter: PayloadMeter | None = None,
        referencer: RowReferencer | None = None,
    ) -> None:
        self.client = client
        self.deadline_s = deadline_s
        self.meter = meter
        self.referencer = referencer

    async def rollouts(
        self, row: Mapping[str, Any], *, task_index: int, group_size: int
    ) -> list[RolloutRecord]:
        if self.referencer is not None:  # decode + hash + one file write per new medium: off the loop
            row = await asyncio.to_thread(self.referencer.row, row)
        rows = indexed_rows(row, task_index, group_size)
        sent: set[str] = set()  # a referenced medium's bytes cross once per prompt, its URL G times
        returned: set[str] = set()
        if self.meter is not None:
            self.meter.record("prompt_repeat", rows)
            for r in rows:
                self.meter.record("gym_request", r, sent_keys=sent)
        outcomes = await asyncio.gather(
            *(self.client.run(r, deadline_s=self.deadline_s, index=i) for i, r in enumerate(rows))
        )
        records: list[RolloutRecord] = []
        for i, out in enumerate(outcomes):
            if out.result is not None:
                if self.meter is not None:
                    self.meter.record("gym_return", out.result, sent_keys=returned)
                records.append(
                    RolloutRecord(
                        task_index, i, result=out.result, attempts=out.attempts, elapsed_s=out.elapsed_s
                    )
                )
            else:
                records.append(
                    RolloutRecord(
                        task_index,
                        i,
                        failure_class=out.kind if out.kind in _OWN_CLASSES else f"gym_{out.kind}",
                        failure_reason=out.reason or "no reason given",
                        attempts=out.attempts,
                        elapsed_s=out.elapsed_s,
                    )
                )
        return records

    def unmetered(self) -> GymRollouts:
        """The same source, measuring nothing: validation's rollouts stay out of the payload table (the
        client, or the generator, is shared; close only the original)."""
        out: GymRollouts = _unmetered(self)
        return out

    async def aclose(self) -> None:
        """The client belongs to the caller: it is not closed here."""


class NativeRollouts:
    """The native path: :func:`~gymbridge.rollout.run_episode` against the environment at ``env_url``.

    Unless it batches concurrent requests itself (vLLM), the generator is wrapped once in a
    :class:`~gymbridge.generation.BatchingGenerator`, so the model calls of concurrent
    rollouts share forward passes. ``episode_kwargs`` go to
    ``run_episode`` (``mode``, ``codec``, ``max_model_len``, ``tool_media``, ...).

    ``seed``: every rollout samples with its own seed, :func:`~gymbridge.bridge.rollout_seed`
    of ``(seed, task index, rollout index)``: the G rollouts of a prompt differ, a rerun draws
    the same samples (a seeded rollout's model calls are not batched with other rollouts',
    since a backend seeds a whole batch). The sampling settings are ``sampling`` or, as
    ``run_episode`` reads them, the row's ``temperature`` / ``top_p`` / ``max_output_tokens``.
    """

    def __init__(
        self,
        generator: Generator,
        env_url: str,
        *,
        max_turns: int = 8,
        sampling: SamplingConfig | None = None,
        media_policy: MediaPolicy | None = None,
        timeout_s: float = 120.0,
        max_batch_size: int = 64,
        meter: PayloadMeter | None = None,
        seed: int | None = None,
        **episode_kwargs: Any,
    ) -> None:
        from gymbridge.generation.batching import BatchingGenerator, needs_batching

        self.env_url = env_url
        self.max_turns = max_turns
        self.sampling = sampling
        self.media_policy = media_policy
        self.timeout_s = timeout_s
        self.meter = meter
        self.seed = seed
        self._owned = needs_batching(generator)
        self.generator: Any = (
            generator if not self._owned else BatchingGenerator(generator, max_batch_size=max_batch_size)
        )
        episode_kwargs.setdefault("codec", getattr(generator, "codec", None))
        episode_kwargs.setdefault("max_model_len", getattr(generator, "max_model_len", None))
        self.episode_kwargs = episode_kwargs

    async def _one(self, row: dict[str, Any], task_index: int, index: int) -> RolloutRecord:
        from gymbridge.rollout import run_episode

        started = time.monotonic()
        sampling = self.sampling
        try:
            if self.seed is not None:
                sampling = self._seeded(row, rollout_seed(self.seed, task_index, index))
            result = await run_episode(
                self.generator,
                self.env_url,
                row,
                max_turns=self.max_turns,
                sampling=sampling,
                media_policy=self.media_policy,
                timeout_s=self.timeout_s,
                **self.episode_kwargs,
            )
        except Exception as exc:  # any failure of one rollout is its record, not the group's
            if not isinstance(exc, GymbridgeError):
                logger.exception("native rollout %d/%d raised", task_index, index)
            logger.warning("native rollout %d/%d failed: %s: %s", task_index, index, type(exc).__name__, exc)
            return RolloutRecord(
                task_index,
                index,
                failure_class=str(getattr(exc, "failure_class", type(exc).__name__)),
                failure_reason=str(exc) or repr(exc),
                attempts=1,
                elapsed_s=time.monotonic() - started,
            )
        return RolloutRecord(
            task_index, index, result=result, attempts=1, elapsed_s=time.monotonic() - started
        )

    def _seeded(self, row: Mapping[str, Any], seed: int) -> SamplingConfig:
        """``sampling`` (else the row's sampling fields, validated exactly as ``run_episode`` does:
        a bad value is ``ProtocolError``) with ``seed``."""
        from gymbridge.rollout import row_sampling

        if self.sampling is not None:
            return replace(self.sampling, seed=seed)
        rcp = row.get("responses_create_params")
        if not isinstance(rcp, Mapping):
            rcp = {}
        default_max_tokens = self.episode_kwargs.get("default_max_tokens") or 1024
        return replace(row_sampling(rcp, int(default_max_tokens)), seed=seed)

    async def rollouts(
        self, row: Mapping[str, Any], *, task_index: int, group_size: int
    ) -> list[RolloutRecord]:
        rows = indexed_rows(row, task_index, group_size)
        if self.meter is not None:
            self.meter.record("prompt_repeat", rows)
        return list(await asyncio.gather(*(self._one(r, task_index, i) for i, r in enumerate(rows))))

    def unmetered(self) -> NativeRollouts:
        """The same source, measuring nothing: validation's rollouts stay out of the payload table (the
        client, or the generator, is shared; close only the original)."""
        out: NativeRollouts = _unmetered(self)
        return out

    async def aclose(self) -> None:
        if self._owned:
            await self.generator.aclose()


class RoutedRollouts:
    """Each row's rollouts from the source of the environment its ``agent_ref`` names.

    ``routes``: environment name -> its source. A row naming no environment, or one not in
    ``routes``, is ``group_size`` failure records of class ``unroutable`` (data, as any bad row);
    :meth:`aclose` closes every route's source.
    """

    def __init__(self, routes: Mapping[str, RolloutSource]) -> None:
        if not routes:
            raise ValueError("routes: give at least one environment's source")
        self.routes = dict(routes)

    async def rollouts(
        self, row: Mapping[str, Any], *, task_index: int, group_size: int
    ) -> list[RolloutRecord]:
        env = env_of_row(row)
        source = self.routes.get(env) if env is not None else None
        if source is None:
            named = "no environment (agent_ref)" if env is None else f"environment {env!r}"
            reason = f"the row names {named}; this run's are {sorted(self.routes)}"
            return [
                RolloutRecord(task_index, i, failure_class="unroutable", failure_reason=reason)
                for i in range(group_size)
            ]
        return await source.rollouts(row, task_index=task_index, group_size=group_size)

    def unmetered(self) -> RoutedRollouts:
        """The same routes, measuring nothing (:meth:`GymRollouts.unmetered`)."""
        return RoutedRollouts({env: unmetered(source) for env, source in self.routes.items()})

    async def aclose(self) -> None:
        for source in self.routes.values():
            await source.aclose()
