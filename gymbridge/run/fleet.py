"""A generator fleet: ``generator.replicas`` model servers behind a router this process owns.

:func:`start_fleet` (called by :func:`~gymbridge.run.placement.start_generator` when
``generator.replicas > 1`` with ``placement: process``) starts N ``gymbridge model serve``
children (each in its own session, log ``model_server_<i>.log``, its own ``CUDA_VISIBLE_DEVICES``:
:func:`replica_devices`), a :class:`~gymbridge.generation.router.FleetRouter` whose URL is the run's
one model URL, a :class:`FleetPublisher` and a :class:`FleetManager` that watches them.

A replica's life (:class:`~gymbridge.generation.router.ReplicaState`): STALE until it holds the
current weights, then HEALTHY; its process exiting (or ``dead_after_probes`` failed health
probes, or a weight sync it failed) makes it DEAD: its calls in flight are cancelled and go to
another replica; the manager restarts it after a back-off (``restart_backoff_s``, doubled each
time, at most ``max_restarts`` over the run): RESTARTING, then STALE until it has the current
version, then HEALTHY again. Fewer live replicas (HEALTHY or SUSPECT) than ``min_healthy`` stops
the run with a :class:`~gymbridge.errors.GeneratorFleetError` naming the floor: every group in
flight raises it (:class:`FleetGuardedSource`), so does the next publication, and the router
answers every call ``generator_lost`` with it.

Publication (:class:`FleetPublisher`): every version goes to every attached replica, in parallel.
With shared memory the trainer writes the version **once** into the segment no replica uses and
each replica swaps to it (a replica stages the swap behind a generation in flight: a segment is
written again only once every replica's swap away from it is live). The segments stay in
``/dev/shm`` until the run ends, so a restarted replica maps them too and swaps straight to the
current version: it serves again within seconds of its start. With the broadcast each replica
has a weight group of its own (so one can be replaced without re-forming the others'), and a
restarted replica joins at the next publication, STALE until then. The step's ``weight_sync_s``
is the publication's wall time: the slowest replica's.

Invariants: no replica is routed a call before it holds the version the trainer last published
(the drift guard, ``trainer.ratio_tolerance``, stays the proof); every process is stopped when the
run's exit stack closes (the manager is registered on it before the first child starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gymbridge.errors import ConfigError, GeneratorFleetError, GeneratorProcessError, WeightSyncError
from gymbridge.generation.router import FleetRouter, ReplicaState
from gymbridge.trainer.weight_sync import DistributedPublisher, is_loopback_url

if TYPE_CHECKING:
    from gymbridge.run.generator_process import ModelServerProcess
    from gymbridge.run.placement import GeneratorConfig, GeneratorHandle

logger = logging.getLogger(__name__)

__all__ = ["FleetGuardedSource", "FleetManager", "FleetPublisher", "replica_devices", "start_fleet"]

MAX_BACKOFF_S = 30.0
WATCH_INTERVAL_S = 0.2
"""How often the manager looks at its children (a ``kill -9`` is noticed within this)."""


def replica_devices(
    replicas: int,
    *,
    devices_per_replica: int | None,
    devices: Sequence[int] | None = None,
    tensor_parallel_size: int | None = None,
    vllm: bool = True,
    visible: Sequence[str] | None = None,
) -> list[str | None]:
    """Each replica's ``CUDA_VISIBLE_DEVICES`` (``None``: leave the environment alone).

    Replica ``i`` takes the ``i``-th run of ``k`` devices from ``devices`` (default: ``visible``, the
    GPUs this process sees: its ``CUDA_VISIBLE_DEVICES`` or every CUDA device), ``k`` being
    ``devices_per_replica``, else, for vLLM model servers where GPUs are visible,
    ``tensor_parallel_size`` (else 1). No GPU, or a transformers model server (``vllm`` false), and
    no ``devices_per_replica``, or ``devices_per_replica: 0``: every replica ``None``. Too few
    devices: :class:`ConfigError`.
    """
    if devices_per_replica == 0 or (devices_per_replica is None and not vllm):
        return [None] * replicas
    pool = [str(d) for d in devices] if devices is not None else list(visible or _visible_gpus())
    if devices_per_replica is None and not pool:
        return [None] * replicas
    per = devices_per_replica if devices_per_replica is not None else (tensor_parallel_size or 1)
    if len(pool) < per * replicas:
        raise ConfigError(
            [
                f"generator.replicas={replicas} x {per} device(s) each needs {per * replicas} GPU(s); "
                f"{len(pool)} available ({','.join(pool) or 'none'}): set generator.devices, "
                "generator.devices_per_replica (0: share them) or fewer replicas"
            ]
        )
    return [",".join(pool[i * per : (i + 1) * per]) for i in range(replicas)]


def _visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no usable CUDA: no GPU to place
        return []


# ---------------------------------------------------------------------------------------------- publisher


class _ReplicaLink(DistributedPublisher):
    """One replica's weight connection: a :class:`DistributedPublisher` (its HTTP client carries the
    run secret) that can also attach to segments the fleet owns."""

    def attach_segments(self, writer: Any, model: Any) -> None:
        from gymbridge.trainer.weight_sync import _lora_body

        self._post(
            "/weights/init_group",
            {
                "transport": "shared_memory",
                "segments": writer.names,
                "nonce": writer.nonce.hex(),
                "tensors": [s.to_json() for s in writer.specs],
                **_lora_body(model),
            },
        )
        self.transport = "shared_memory"

    def live_at_least(self, version: int) -> float:
        """Wait until the server's live ``policy_version`` is ``version`` or newer (a swap the server
        staged behind a running generation; at most ``timeout_s``); returns the seconds waited."""
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        while int(self.status().get("policy_version", -1)) < version:
            if time.monotonic() > deadline:
                raise WeightSyncError(f"policy version {version} did not go live within {self.timeout_s:g}s")
            time.sleep(0.005)
        return time.perf_counter() - started

    def load_segment(self, version: int, segment: int) -> float:
        started = time.perf_counter()
        self._post("/weights/update", {"version": version, "transport": "shared_memory", "segment": segment})
        self.version = version
        return time.perf_counter() - started


class FleetPublisher:
    """Publishes every version to every attached replica (module docstring), in parallel.

    ``on_synced(version, {index: (url, seconds)})`` and ``on_failed(index, url, reason)`` are called from
    the publishing thread; the manager hands them to its event loop. ``fatal()`` is checked first: a
    fleet below its floor publishes nothing.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        transport: Literal["auto", "broadcast", "shared_memory"] = "auto",
        bucket_bytes: int = 64 << 20,
        timeout_s: float = 120.0,
        secret: str | None = None,
        on_synced: Callable[[int, dict[int, tuple[str, float]]], None] | None = None,
        on_failed: Callable[[int, str, str], None] | None = None,
        fatal: Callable[[], BaseException | None] | None = None,
        min_healthy: int = 1,
    ) -> None:
        self.requested_transport = transport
        self.min_healthy = min_healthy
        self.size = len(urls)
        self.transport: Literal["broadcast", "shared_memory"] | None = None
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._secret = secret
        self.on_synced = on_synced
        self.on_failed = on_failed
        self.fatal = fatal
        self._lock = threading.Lock()  # one publication or attachment at a time
        self._links_lock = threading.Lock()  # guards _links / _retired only (short)
        self._links: dict[int, _ReplicaLink] = {i: self._link(u) for i, u in enumerate(urls)}
        self._retired: list[_ReplicaLink] = []
        self._writer: Any = None
        self._model: Any = None
        """The trainer's model of the last publication (the layout a restarted replica is checked on)."""
        self._current = 0
        """The segment holding :attr:`version` (shared memory)."""
        self._segment_versions: list[int | None] = [None, None]
        """The version each segment holds (``None``: never written)."""
        self._last_failures: dict[int, str] = {}
        self._pool = ThreadPoolExecutor(max(1, len(urls)), thread_name_prefix="gb-fleet-sync")
        self.version: int | None = None
        self.syncs = 0
        self.last_bytes = 0
        self.last_sync_s = 0.0
        self.last_timings: dict[str, float] = {}
        """``write_s`` (shared memory: the one copy into the segment), ``slowest_s`` (the slowest
        replica's share), ``replicas`` (how many took the version)."""

    def _link(self, url: str) -> _ReplicaLink:
        return _ReplicaLink(
            url,
            bucket_bytes=self.bucket_bytes,
            timeout_s=self.timeout_s,
            transport="broadcast",
            secret=self._secret,
        )

    # ------------------------------------------------------------------ attach / detach

    def detach(self, index: int) -> None:
        """Replica ``index`` is gone: publish nothing more to it (thread-safe, never blocks long)."""
        with self._links_lock:
            link = self._links.pop(index, None)
            if link is not None:
                self._retired.append(link)

    def attach(self, index: int, url: str) -> int | None:
        """Replica ``index`` is a new process at ``url``; returns the version it now holds, or ``None``
        when it takes the next publication (the broadcast, or nothing published yet). Raises
        :class:`WeightSyncError` when it refuses."""
        with self._lock:
            self._close_retired()
            link = self._link(url)
            try:
                if self.transport == "shared_memory" and self._writer is not None:
                    link.attach_segments(self._writer, self._model)
                    if self.version is not None:
                        link.load_segment(self.version, self._current)
                    loaded = self.version
                else:
                    loaded = None
            except BaseException:
                link.close()
                raise
            with self._links_lock:
                old = self._links.pop(index, None)
                if old is not None:
                    self._retired.append(old)
                self._links[index] = link
            return loaded

    def _targets(self) -> dict[int, _ReplicaLink]:
        with self._links_lock:
            return dict(self._links)

    def _drop(self, index: int, link: _ReplicaLink, reason: str) -> None:
        with self._links_lock:
            if self._links.get(index) is link:
                del self._links[index]
                self._retired.append(link)
        if self.on_failed is not None:
            self.on_failed(index, link.url, reason)

    def _close_retired(self) -> None:
        with self._links_lock:
            retired, self._retired = self._retired, []
        for link in retired:
            with contextlib.suppress(Exception):
                link.close()

    # ------------------------------------------------------------------ publishing

    def publish(self, model: Any, version: int) -> float:
        """Publish ``model`` as ``version`` to every attached replica; returns the wall seconds (the
        slowest replica's). A replica that fails is dropped and reported (``on_failed``); none taking
        it is a :class:`WeightSyncError`; a fleet below its floor raises its
        :class:`~gymbridge.errors.GeneratorFleetError` before anything moves."""
        started = time.perf_counter()
        with self._lock:
            fatal = self.fatal() if self.fatal is not None else None
            if fatal is not None:
                raise fatal
            if self.version is not None and version < self.version:
                raise WeightSyncError(f"policy version {version} is older than the published {self.version}")
            self._close_retired()
            self._model = model
            if self.transport is None:
                self._connect(model)
            targets = self._targets()
            if self.transport == "shared_memory":
                done = self._publish_shared(model, version, targets)
            else:
                done = self._publish_broadcast(model, version, targets)
            if len(done) < self.min_healthy:
                lost = "; ".join(f"{i}: {why}" for i, why in self._last_failures.items())
                raise GeneratorFleetError(
                    f"the generator fleet has {len(done)} healthy replica(s) of {self.size} holding policy "
                    f"version {version}, below generator.min_healthy={self.min_healthy}"
                    + (f" (lost: {lost})" if lost else ""),
                    healthy=len(done),
                    min_healthy=self.min_healthy,
                    replicas=self.size,
                )
            self.version = version
            self.syncs += 1
            self.last_sync_s = time.perf_counter() - started
            slowest = max((s for _, s in done.values()), default=0.0)
            self.last_timings = {**self.last_timings, "slowest_s": slowest, "replicas": float(len(done))}
            if self.on_synced is not None:
                self.on_synced(version, done)
            return self.last_sync_s

    def _parallel(
        self, targets: dict[int, _ReplicaLink], work: Callable[[_ReplicaLink], float]
    ) -> dict[int, tuple[str, float]]:
        futures = {i: (link, self._pool.submit(work, link)) for i, link in targets.items()}
        done: dict[int, tuple[str, float]] = {}
        self._last_failures = {}
        for i, (link, future) in futures.items():
            try:
                done[i] = (link.url, float(future.result()))
            except Exception as exc:  # one replica's failure: dropped, restarted by the manager
                logger.warning("generator replica %d (%s) failed a weight sync: %s", i, link.url, exc)
                self._last_failures[i] = str(exc)
                self._drop(i, link, f"weight sync failed: {exc}")
        return done

    def _publish_shared(
        self, model: Any, version: int, targets: dict[int, _ReplicaLink]
    ) -> dict[int, tuple[str, float]]:
        from gymbridge.generation.weights import published_weights

        named = published_weights(model)
        segment = 1 - self._current if self.version is not None else self._current
        started = time.perf_counter()
        if self._segment_versions[segment] is not None and self.version is not None:
            # a replica reads this segment until its swap to the current version is live (a server
            # stages the swap behind a running generation): each must be past it before the write
            live = self._parallel(targets, lambda link: link.live_at_least(int(self.version or 0)))
            targets = {i: link for i, link in targets.items() if i in live}
        self._writer.write(segment, [t for _, t in named])  # once, whatever the number of replicas
        write_s = time.perf_counter() - started
        done = self._parallel(targets, lambda link: write_s + link.load_segment(version, segment))
        self._current = segment
        self._segment_versions[segment] = version
        self.last_bytes = sum(t.numel() * t.element_size() for _, t in named)
        self.last_timings = {"write_s": write_s}
        return done

    def _publish_broadcast(
        self, model: Any, version: int, targets: dict[int, _ReplicaLink]
    ) -> dict[int, tuple[str, float]]:
        done = self._parallel(targets, lambda link: link.publish(model, version))
        self.last_bytes = max((link.last_bytes for link in targets.values()), default=0)
        self.last_timings = {}
        return done

    def _connect(self, model: Any) -> None:
        """The first publication: set up the transport with every replica (``auto``: shared memory when
        every replica is on this host, the model on the CPU and every replica maps the segments)."""
        from gymbridge.trainer.weight_sync import _on_cpu

        wanted = self.requested_transport
        targets = self._targets()
        local = all(is_loopback_url(link.url) for link in targets.values())
        if wanted == "shared_memory" or (wanted == "auto" and local and _on_cpu(model)):
            try:
                self._connect_shared(model, targets)
                return
            except WeightSyncError as exc:
                if wanted == "shared_memory":
                    raise
                logger.info("shared-memory weight sync unavailable (%s): broadcasting instead", exc)
        self.transport = "broadcast"
        logger.info("fleet weight sync: a broadcast group per replica (%d)", len(targets))

    def _connect_shared(self, model: Any, targets: dict[int, _ReplicaLink]) -> None:
        from gymbridge.generation.shared_weights import SharedWeightsWriter
        from gymbridge.generation.weights import TensorSpec, published_weights

        specs = [
            TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for n, t in published_weights(model)
        ]
        writer = SharedWeightsWriter(specs)
        try:
            futures = [self._pool.submit(link.attach_segments, writer, model) for link in targets.values()]
            for future in futures:
                future.result()
        except BaseException:
            writer.close()
            raise
        # the segments stay linked while the run lasts: a restarted replica maps them by name
        self._writer = writer
        self._current = 0
        self.transport = "shared_memory"
        logger.info(
            "fleet weight sync through shared memory: %d replica(s) read one pair of segments "
            "(%.1f MiB each)",
            len(targets),
            writer.nbytes / 2**20,
        )

    def close(self) -> None:
        with self._links_lock:
            links = [*self._links.values(), *self._retired]
            self._links, self._retired = {}, []
        for link in links:
            with contextlib.suppress(Exception):
                link.close()
        if self._writer is not None:
            self._writer.close()  # unlinks the segments
            self._writer = None
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------------------------- manager


class FleetManager:
    """Starts, watches and restarts the fleet's processes (module docstring)."""

    def __init__(
        self,
        commands: Sequence[Sequence[str]],
        envs: Sequence[dict[str, str]],
        *,
        log_dir: Path,
        startup_timeout_s: float = 180.0,
        max_restarts: int = 5,
        restart_backoff_s: float = 1.0,
        min_healthy: int = 1,
        publish: bool = True,
        probe_interval_s: float = 1.0,
        probe_timeout_s: float = 5.0,
        dead_after_probes: int = 3,
    ) -> None:
        if len(commands) != len(envs) or not commands:
            raise ValueError("one command and one environment per replica")
        self.commands = [list(c) for c in commands]
        self.envs = [dict(e) for e in envs]
        self.log_dir = log_dir
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.restart_backoff_s = restart_backoff_s
        self.min_healthy = min_healthy
        self.publishing = publish
        self._probe = (probe_interval_s, probe_timeout_s, dead_after_probes)
        self.children: list[ModelServerProcess | None] = [None] * len(commands)
        self.restart_attempts = [0] * len(commands)
        self.router: FleetRouter | None = None
        self.publisher: FleetPublisher | None = None
        self.fatal: GeneratorFleetError | None = None
        self.fatal_event = asyncio.Event()
        """Set with :attr:`fatal` (what :class:`FleetGuardedSource` waits on)."""
        self._armed = not publish  # the floor counts from the first publication (or at once)
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._restarts: dict[int, asyncio.Task[None]] = {}

    @property
    def size(self) -> int:
        return len(self.commands)

    def log_path(self, index: int) -> Path:
        return self.log_dir / f"model_server_{index}.log"

    @property
    def pids(self) -> list[int | None]:
        return [c.pid if c is not None else None for c in self.children]

    # ------------------------------------------------------------------ lifecycle

    async def start(self, *, port: int = 0) -> str:
        """Start every replica (in parallel) and the router on ``port``; returns the router's URL.
        Register :meth:`aclose` on an exit stack first: a failed start leaves nothing running after it."""
        self._loop = asyncio.get_running_loop()
        started = await asyncio.gather(
            *(asyncio.to_thread(self._spawn, i) for i in range(self.size)), return_exceptions=True
        )
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        urls = [c.url for c in self.children if c is not None]
        interval, timeout, dead_after = self._probe
        self.router = FleetRouter(
            urls,
            initial_state=ReplicaState.STALE if self.publishing else ReplicaState.HEALTHY,
            probe_interval_s=interval,
            probe_timeout_s=timeout,
            dead_after_probes=dead_after,
            on_dead=self._declared_dead,
            on_exhausted=self.poll,
        )
        url = await self.router.start(port=port)
        self._watch_task = asyncio.create_task(self._watch(), name="gymbridge-fleet-watch")
        return url

    def _spawn(self, index: int) -> ModelServerProcess:
        """Start replica ``index``'s process (in a worker thread) and record it."""
        from gymbridge.run.generator_process import start_model_server_process

        command = self.commands[index]
        if self.restart_attempts[index]:  # a new life draws new samples, not its first life's again
            command = _reseeded(command, f"restart-{self.restart_attempts[index]}")
        child = start_model_server_process(
            command,
            log_path=self.log_path(index),
            startup_timeout_s=self.startup_timeout_s,
            env=self.envs[index],
        )
        self.children[index] = child
        if self._closing:  # the run ended while it started
            child.stop(2.0)
            raise GeneratorProcessError(f"replica {index} started after the fleet closed")
        return child

    async def aclose(self) -> None:
        """Stop watching and restarting, close the publisher, the router, then every process."""
        self._closing = True
        tasks = [t for t in (self._watch_task, *self._restarts.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close)
        if self.router is not None:
            await self.router.stop()
        children = [c for c in self.children if c is not None]
        await asyncio.gather(*(asyncio.to_thread(c.stop) for c in children))

    # ------------------------------------------------------------------ events

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the fleet's event loop (from any thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if _on_loop(loop):
            fn(*args)
        else:
            loop.call_soon_threadsafe(fn, *args)

    def synced(self, version: int, done: dict[int, tuple[str, float]]) -> None:
        """A publication reached ``done`` (on the loop): they hold ``version``; a STALE one serves now."""
        router = self.router
        assert router is not None
        for index, (url, seconds) in done.items():
            replica = router.replicas[index]
            if replica.url != url.rstrip("/"):
                continue  # replaced meanwhile
            replica.policy_version = version
            replica.sync_s = seconds
            if replica.state is ReplicaState.STALE:
                router.set_state(index, ReplicaState.HEALTHY)
        self._armed = True
        self._check_floor()

    def sync_failed(self, index: int, url: str, reason: str) -> None:
        router = self.router
        if router is None or router.replicas[index].url != url.rstrip("/"):
            return
        self.lost(index, reason)

    def _declared_dead(self, index: int, reason: str) -> None:
        self.lost(index, reason, declared=True)

    def lost(self, index: int, reason: str, *, declared: bool = False) -> None:
        """Replica ``index`` is gone (on the loop): DEAD, detached, restarted unless the cap is reached."""
        router = self.router
        assert router is not None
        if not declared:
            router.set_state(index, ReplicaState.DEAD, reason)
        if self.publisher is not None:
            self.publisher.detach(index)
        self._check_floor()
        if self._closing or self.fatal is not None or index in self._restarts:
            return
        if self.restart_attempts[index] >= self.max_restarts:
            why = f"{reason}; not restarted: generator.max_restarts={self.max_restarts}"
            router.replicas[index].reason = why
            logger.error("generator replica %d: %s", index, why)
            return
        task = asyncio.get_running_loop().create_task(
            self._restart(index), name=f"gymbridge-fleet-restart-{index}"
        )
        self._restarts[index] = task

        def forget(_task: asyncio.Task[None]) -> None:
            if self._restarts.get(index) is _task:
                del self._restarts[index]

        task.add_done_callback(forget)

    def _check_floor(self) -> None:
        router = self.router
        if router is None or not self._armed or self.fatal is not None or self._closing:
            return
        live = [r for r in router.replicas if r.state in (ReplicaState.HEALTHY, ReplicaState.SUSPECT)]
        if len(live) >= self.min_healthy:
            return
        self.fatal = GeneratorFleetError(
            f"the generator fleet has {len(live)} healthy replica(s) of {self.size}, below "
            f"generator.min_healthy={self.min_healthy}: {router.describe()}; logs "
            f"{self.log_dir}/model_server_<i>.log",
            healthy=len(live),
            min_healthy=self.min_healthy,
            replicas=self.size,
        )
        router.fatal = str(self.fatal)
        self.fatal_event.set()
        logger.error("%s", self.fatal)
        for task in self._restarts.values():
            task.cancel()

    # ------------------------------------------------------------------ watching, restarting

    async def _watch(self) -> None:
        router = self.router
        assert router is not None
        while True:
            self.poll()
            await asyncio.sleep(WATCH_INTERVAL_S)

    def poll(self) -> None:
        """Look at every replica's process now (on the loop): one that exited is lost."""
        router = self.router
        assert router is not None
        for index, child in enumerate(self.children):
            state = router.replicas[index].state
            if child is None or state in (ReplicaState.DEAD, ReplicaState.RESTARTING):
                continue
            code = child.proc.poll()
            if code is not None:
                self.lost(index, f"process {child.pid} exited with {code}")

    async def _restart(self, index: int) -> None:
        router = self.router
        assert router is not None
        while not self._closing and self.fatal is None:
            if self.restart_attempts[index] >= self.max_restarts:
                router.set_state(
                    index, ReplicaState.DEAD, f"gave up after generator.max_restarts={self.max_restarts}"
                )
                return
            delay = min(self.restart_backoff_s * 2 ** self.restart_attempts[index], MAX_BACKOFF_S)
            self.restart_attempts[index] += 1
            await asyncio.sleep(delay)
            router.set_state(index, ReplicaState.RESTARTING, f"restart {self.restart_attempts[index]}")
            old = self.children[index]
            if old is not None:
                await asyncio.to_thread(old.stop, 2.0)
            try:
                child = await asyncio.to_thread(self._spawn, index)
            except GeneratorProcessError as exc:
                router.set_state(index, ReplicaState.DEAD, str(exc).splitlines()[0])
                continue
            router.replace(index, child.url)  # STALE: no call until it holds the current weights
            if self.publisher is None:
                router.set_state(index, ReplicaState.HEALTHY)
                return
            try:
                version = await asyncio.to_thread(self.publisher.attach, index, child.url)
            except (WeightSyncError, OSError) as exc:
                router.set_state(index, ReplicaState.DEAD, f"re-sync failed: {exc}")
                continue
            if version is not None and router.replicas[index].url == child.url.rstrip("/"):
                router.replicas[index].policy_version = version
                router.set_state(index, ReplicaState.HEALTHY)
            logger.info(
                "generator replica %d restarted (process %d)%s",
                index,
                child.pid,
                f", re-synced to v{version}" if version is not None else ", joins at the next publication",
            )
            return


class FleetGuardedSource:
    """A rollout source over a generator fleet: once the fleet is below its floor, every group in
    flight or to come raises the fleet's :class:`~gymbridge.errors.GeneratorFleetError`, which the
    bridge lets through (the run stops, naming the floor) instead of failing prompt after prompt."""

    def __init__(self, source: Any, fleet: FleetManager) -> None:
        self.source = source
        self.fleet = fleet

    async def rollouts(self, row: Any, *, task_index: int, group_size: int) -> Any:
        if self.fleet.fatal is not None:
            raise self.fleet.fatal
        inner = asyncio.ensure_future(self.source.rollouts(row, task_index=task_index, group_size=group_size))
        stop = asyncio.ensure_future(self.fleet.fatal_event.wait())
        try:
            await asyncio.wait({inner, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not inner.done():
                inner.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await inner
        if self.fleet.fatal is not None:
            raise self.fleet.fatal
        return inner.result()

    def unmetered(self) -> FleetGuardedSource:
        from gymbridge.bridge.sources import unmetered

        return FleetGuardedSource(unmetered(self.source), self.fleet)

    async def aclose(self) -> None:
        await self.source.aclose()


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _reseeded(command: Sequence[str], salt: str) -> list[str]:
    """``command`` with its ``--prompt-seed`` (if any) replaced by a hash of (that seed, ``salt``)."""
    import hashlib

    one = list(command)
    if "--prompt-seed" in one:
        at = one.index("--prompt-seed") + 1
        digest = hashlib.sha256(f"gymbridge-replica:{one[at]}:{salt}".encode()).digest()
        one[at] = str(int.from_bytes(digest[:8], "big") >> 1)
    return one


def replica_commands(command: Sequence[str], replicas: int) -> list[list[str]]:
    """``command`` for each replica, each with a prompt seed of its own (``--prompt-seed``): replica 0
    keeps the run's, replica ``i`` gets a hash of ``(seed, i)`` (and a restarted one a hash of its
    restart, :meth:`FleetManager._spawn`). The same seed everywhere would give every replica the same
    per-prompt sample stream, so the G rollouts of a group split over two replicas would come in
    identical pairs."""
    return [list(command) if i == 0 else _reseeded(command, str(i)) for i in range(replicas)]


async def start_fleet(
    cfg: GeneratorConfig,
    stack: contextlib.AsyncExitStack,
    command: Sequence[str],
    *,
    weights_secret: str,
    log_dir: Path,
    port: int = 0,
) -> GeneratorHandle:
    """``cfg.replicas`` children running ``command`` behind a router on ``port`` (module docstring)."""
    from gymbridge.generation.server import WEIGHTS_SECRET_ENV
    from gymbridge.run.placement import GeneratorHandle

    devices = replica_devices(
        cfg.replicas,
        devices_per_replica=cfg.devices_per_replica,
        devices=cfg.devices,
        tensor_parallel_size=cfg.tensor_parallel_size,
        vllm="vllm" in command,
    )
    envs: list[dict[str, str]] = []
    for visible in devices:
        env = {WEIGHTS_SECRET_ENV: weights_secret} if cfg.publish_weights else {}
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        envs.append(env)
    manager = FleetManager(
        replica_commands(command, cfg.replicas),
        envs,
        log_dir=log_dir,
        startup_timeout_s=cfg.startup_timeout_s,
        max_restarts=cfg.max_restarts,
        restart_backoff_s=cfg.restart_backoff_s,
        min_healthy=cfg.min_healthy,
        publish=cfg.publish_weights,
    )
    stack.push_async_callback(manager.aclose)  # before the first child exists
    url = await manager.start(port=port)
    if cfg.publish_weights:
        assert manager.router is not None
        manager.publisher = FleetPublisher(
            [r.url for r in manager.router.replicas],
            transport=cfg.weight_transport,
            bucket_bytes=cfg.bucket_mb << 20,
            timeout_s=cfg.sync_timeout_s,
            secret=weights_secret,
            on_synced=lambda v, done: manager._call_soon(manager.synced, v, done),
            on_failed=lambda i, u, why: manager._call_soon(manager.sync_failed, i, u, why),
            fatal=lambda: manager.fatal,
            min_healthy=cfg.min_healthy,
        )
    placed = ", ".join(f"{i}: {d}" for i, d in enumerate(devices) if d is not None)
    logger.info(
        "generator fleet: %d replicas (pids %s) behind %s%s",
        cfg.replicas,
        ", ".join(str(p) for p in manager.pids),
        url,
        f"; CUDA_VISIBLE_DEVICES {placed}" if placed else "",
    )
    return GeneratorHandle("process", None, url, manager.publisher, pid=manager.pids[0], fleet=manager)
