"""Weight publication: after every optimizer step the trainer hands its weights to the generator.

A :class:`WeightPublisher` publishes the trainer's model as policy version ``v`` (an int,
0 = the initial weights, then one per optimizer step) and reports the seconds it spent.
Two implementations:

* :class:`InProcessPublisher` (``generator.placement: in_process``): the generator owns a
  model object of its own in the trainer's process; the trainer's parameters and buffers are
  copied into a staging copy, and the generator swaps them in (and takes the version) at its
  next generation boundary. A generator that *shares* the trainer's model object only gets
  its version advanced.
* :class:`DistributedPublisher` (``generator.placement: process``): the generator is a model
  server in another process. Control goes over the server's HTTP routes
  (``POST /weights/init_group``, ``POST /weights/update``; refused unless the server was
  started with ``--enable-weight-updates``). The tensors travel one of two ways
  (``transport``):

  - ``broadcast``: a private torch.distributed group (gloo on CPU, NCCL on CUDA;
    :mod:`gymbridge.generation.weights`), as broadcasts of bounded flat buckets, packing the
    next bucket while the previous one is on the wire. The server answers an update with
    202 once it has checked the layout and is waiting for the buckets, and marks the
    version staged in the group's store; :meth:`DistributedPublisher.publish` returns after
    that mark;
  - ``shared_memory``: two ``/dev/shm`` segments (:mod:`gymbridge.generation.shared_weights`):
    the trainer copies the weights into the segment the generator is not using and the
    server, answering the update, stages pointing its model at it. One copy, no socket. Only
    for a CPU model and a server on this host. A write waits until the swap away from its
    segment is live (only when the previous publication still waits for a generation to end);
  - ``auto`` (the default): ``shared_memory`` when the server's URL is a loopback address,
    the model is on the CPU and ``/dev/shm`` has room, falling back to ``broadcast`` (with
    a log line) when the server refuses the segments; ``broadcast`` otherwise.

With LoRA (:mod:`gymbridge.generation.lora`) a publication carries only what training changes: the
adapters (and any tensor trained in full), :func:`~gymbridge.generation.weights.published_weights`;
the generator holds the same base and the same adapter layout (an in-process generator is built
with them; a model server is told the adapter settings in ``init_group``'s ``lora`` and injects them).
Every publisher reports the bytes of its last publication (``last_bytes``).

Invariants: versions only go up (publishing an older version is refused); a publish stages the
whole version without waiting for a running generation (but over the staging bound, or as above)
or raises :class:`~gymbridge.errors.WeightSyncError`; the generator's
:class:`~gymbridge.generation.weights.WeightGate` swaps it in at a generation boundary, so no
generation runs on half-copied weights and every one starting after ``publish`` returned runs on
it; a layout mismatch is refused before any tensor moves. The generator's ``policy_version``
(``/weights/status``) is the live version.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import torch

from gymbridge.errors import WeightSyncError
from gymbridge.generation.lora import published_names
from gymbridge.generation.weights import (
    DEFAULT_ALONE_BYTES,
    DEFAULT_BUCKET_BYTES,
    DEFAULT_STAGING_BYTES,
    Backend,
    BucketBuffers,
    TensorSpec,
    WeightGate,
    WeightGroup,
    WeightTarget,
    bucket_into,
    check_layout,
    loaded_key,
    named_weights,
    open_weight_group,
    plan_buckets,
    published_weights,
    single_tensor,
    weight_gate,
    weight_store,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DistributedPublisher",
    "InProcessPublisher",
    "WeightPublisher",
    "WeightTransport",
    "copy_weights",
    "is_loopback_url",
    "payload_bytes",
]

WeightTransport = Literal["auto", "broadcast", "shared_memory"]
"""How :class:`DistributedPublisher` moves the tensors (see the module docstring)."""


class WeightPublisher(Protocol):
    """Publishes the trainer's weights as one policy version (see the module docstring)."""

    def publish(self, model: Any, version: int) -> float:
        """Make ``model``'s current weights the generator's, as ``version``; returns seconds spent."""
        ...

    def close(self) -> None:
        """Release what the publisher holds (connections, groups); idempotent."""
        ...


def copy_weights(source: Any, target: Any) -> int:
    """Copy ``source``'s weights into ``target``'s own tensors in place; returns the bytes copied
    (in ``source``'s dtypes, as :func:`payload_bytes` counts them).

    Both models must have the same layout (:func:`~gymbridge.generation.weights.check_layout`),
    else :class:`WeightSyncError` lists every mismatch and nothing is copied. A LoRA ``source``
    copies only its published tensors (adapters, fully trained tensors). A floating tensor is
    cast to the receiver's floating dtype (fp32 master weights into a bf16 generator); names,
    shapes and every other dtype must match.
    """
    named = _checked_named(source, target)
    own = target.state_dict()
    with torch.no_grad():
        for name, tensor in named:
            own[name].copy_(tensor)
    return _nbytes(named)


def _checked_named(source: Any, target: Any) -> list[tuple[str, torch.Tensor]]:
    """``source``'s published entries, once :func:`copy_weights`'s layout check passed."""
    named = published_weights(source)
    partial = published_names(source) is not None  # LoRA: the base is never sent
    own = target.state_dict()

    def sent_as(name: str, t: torch.Tensor) -> str:
        mine = own.get(name)
        cast = mine is not None and t.is_floating_point() and mine.is_floating_point()
        return str(mine.dtype if cast and mine is not None else t.dtype).removeprefix("torch.")

    specs = [TensorSpec(n, tuple(t.shape), sent_as(n, t)) for n, t in named]
    problems = check_layout(specs, target, partial=partial)
    if problems:
        raise WeightSyncError(
            "the generator's model does not match the trainer's: " + "; ".join(problems[:8])
        )
    return named


class InProcessPublisher:
    """Publish into a generator in this process that owns its own model (``HFGenerator``).

    :meth:`publish` copies the trainer's weights into a staging copy (the generator's dtypes and
    device; kept between publications: one extra copy of the published weights, at most
    ``staging_bytes``), then stages the swap with the generator's
    :class:`~gymbridge.generation.weights.WeightGate` and returns: a running generation ends on
    the old weights, every generation starting later runs on ``version`` (the swap, a copy from
    staging, happens in between). Over ``staging_bytes``, or for a generator with a plain lock, the
    weights are copied into the live model under the lock (waiting for a running generation).
    A generator sharing the trainer's model only has its version advanced (staged the same way).
    """

    def __init__(self, generator: WeightTarget, *, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.generator = generator
        self.staging_bytes = staging_bytes
        self.syncs = 0
        self.last_bytes = 0
        """Bytes the last publication copied (0 when the generator shares the trainer's model)."""
        self.version: int | None = None
        """The last version published: live, or staged behind a running generation."""
        self._staging: dict[str, torch.Tensor] = {}

    def publish(self, model: Any, version: int) -> float:
        started = time.perf_counter()
        generator = self.generator
        newest = max(generator.policy_version, self.version if self.version is not None else 0)
        if version < newest:
            raise WeightSyncError(f"policy version {version} is older than the generator's {newest}")
        gate = weight_gate(generator)
        swap = self._staged_swap(gate, model, version) if gate is not None else None
        if gate is not None and swap is not None:
            gate.stage(version, swap)
        else:  # into the live model at a generation boundary
            with generator.weights_lock:
                if generator.model is not model:
                    self.last_bytes = copy_weights(model, generator.model)
                generator.policy_version = version
        self.version = version
        self.syncs += 1
        return time.perf_counter() - started

    def _staged_swap(self, gate: WeightGate, model: Any, version: int) -> Callable[[], None] | None:
        """The swap loading ``model``'s weights as ``version`` from the staging, once they are in it;
        ``None`` when the staging would exceed ``staging_bytes``."""
        generator = self.generator
        target = generator.model

        def take_version() -> None:
            generator.policy_version = version

        if target is model:
            return take_version
        named = _checked_named(model, target)
        own = target.state_dict()
        if sum(own[n].numel() * own[n].element_size() for n, _ in named) > self.staging_bytes:
            return None
        gate.unstage(hold=True)  # a swap still pending reads the staging about to be overwritten
        try:
            staging = self._fill_staging(named, own)
        except BaseException:
            gate.release()
            raise
        self.last_bytes = _nbytes(named)

        def swap() -> None:
            live = target.state_dict()
            with torch.no_grad():
                for name, tensor in staging.items():
                    live[name].copy_(tensor)
            take_version()

        return swap

    def _fill_staging(
        self, named: list[tuple[str, torch.Tensor]], own: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Copy ``named`` (the trainer's) into the staging, made like ``own`` (the generator's) when
        the layout changed."""
        staging = self._staging
        if staging.keys() != {n for n, _ in named} or any(
            (s.shape, s.dtype, s.device) != (own[n].shape, own[n].dtype, own[n].device)
            for n, s in staging.items()
        ):
            self._staging = {}  # the old staging is freed before the new one is made
            staging = self._staging = {n: torch.empty_like(own[n]) for n, _ in named}
        with torch.no_grad():
            for name, tensor in named:
                staging[name].copy_(tensor)
        return staging

    def close(self) -> None:
        return None


def payload_bytes(model: Any) -> int:
    """Bytes a publication of ``model`` sends (:func:`~gymbridge.generation.weights.published_weights`,
    in the trainer's dtypes)."""
    return _nbytes(published_weights(model))


def _nbytes(named: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def is_loopback_url(url: str) -> bool:
    """Whether ``url``'s host is this machine's loopback (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _lora_body(model: Any) -> dict[str, Any]:
    """``init_group``'s ``lora`` entry for a LoRA model (the adapter settings the server injects)."""
    from gymbridge.generation.lora import lora_settings

    settings = lora_settings(model)
    return {"lora": settings} if settings is not None else {}


def _on_cpu(model: Any) -> bool:
    return all(t.device.type == "cpu" for _, t in named_weights(model))


def _default_backend(model: Any) -> Backend:
    first = next(iter(model.parameters()), None)
    on_gpu = first is not None and first.device.type == "cuda"
    return "nccl" if on_gpu and torch.distributed.is_nccl_available() else "gloo"


class DistributedPublisher:
    """Publish to a model server in another process (see the module docstring).

    ``url`` is the server's base URL. The transport is set up on the first :meth:`publish` (or
    :meth:`connect`); for ``broadcast`` the trainer hosts the group's store on ``host``
    (127.0.0.1 by default) on a free port and is rank 0; the server's ranks follow.
    ``bucket_bytes`` bounds each broadcast; ``timeout_s`` bounds joining, each broadcast and
    each HTTP call. :attr:`transport` is the transport in use once connected;
    :attr:`last_timings` splits the last publish (``pack_send_s``: packing and broadcasting,
    or copying into shared memory; ``load_s``: waiting for the server to load it). ``secret`` is the
    run secret the server's weight routes require: every call sends ``Authorization: Bearer <secret>``
    (without it the server answers 401).
    """

    def __init__(
        self,
        url: str,
        *,
        host: str = "127.0.0.1",
        backend: Backend | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 120.0,
        transport: WeightTransport = "auto",
        secret: str | None = None,
    ) -> None:
        import httpx

        if transport not in ("auto", "broadcast", "shared_memory"):
            raise ValueError(f"transport must be auto, broadcast or shared_memory, got {transport!r}")
        self.url = url.rstrip("/")
        self.host = host
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.requested_transport: WeightTransport = transport
        self.transport: Literal["broadcast", "shared_memory", "vllm"] | None = None
        """The transport in use (``None`` until connected); ``vllm``: vLLM's own weight transfer
        (:mod:`gymbridge.trainer.vllm_transfer`), chosen under ``auto`` when the server speaks it."""
        self._vllm: Any = None
        auth = {"Authorization": f"Bearer {secret}"} if secret else None  # kept in the client only
        self._http = httpx.Client(timeout=timeout_s, trust_env=False, headers=auth)
        self._store: Any = None
        self._group: WeightGroup | None = None
        self._buffers: BucketBuffers | None = None
        self._shared: Any = None
        self._next_segment = 0
        self.version: int | None = None
        self.syncs = 0
        self.last_sync_s = 0.0
        self.last_bytes = 0
        """Bytes of tensors the last publication sent."""
        self.last_timings: dict[str, float] = {}

    # ------------------------------------------------------------------ control

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        try:
            reply = self._http.post(f"{self.url}{path}", json=body)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"POST {self.url}{path} failed: {exc}") from exc
        if reply.status_code not in (200, 202):
            try:
                message = reply.json().get("message", reply.text)
            except ValueError:
                message = reply.text
            raise WeightSyncError(f"POST {self.url}{path} -> {reply.status_code}: {message}")
        data = reply.json()
        return data if isinstance(data, dict) else {}

    def status(self) -> dict[str, Any]:
        """The server's ``GET /weights/status`` (``policy_version``, ``ranks``, ``syncs``, ...)."""
        import httpx

        try:
            reply = self._http.get(f"{self.url}/weights/status")
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"GET {self.url}/weights/status failed: {exc}") from exc
        if reply.status_code != 200:
            raise WeightSyncError(f"GET {self.url}/weights/status -> {reply.status_code}: {reply.text}")
        data = reply.json()
        return data if isinstance(data, dict) else {}

    def connect(self, model: Any) -> None:
        """Set up the transport with the server (idempotent); the server checks the layout first."""
        if self._vllm is None and self.requested_transport == "auto" and self.status().get("vllm_transfer"):
            from gymbridge.trainer.vllm_transfer import VLLMTransferPublisher, unsupported_reason

            if unsupported_reason(model) is None:  # full weights on a GPU; else the transports below
                self._vllm = VLLMTransferPublisher(
                    self.url, host=self.host, timeout_s=self.timeout_s, http=self._http
                )
                self._vllm.connect(model)
                self.transport = "vllm"
        if self._group is not None or self._shared is not None or self._vllm is not None:
            return
        wanted = self.requested_transport
        if wanted == "shared_memory" or (
            wanted == "auto" and is_loopback_url(self.url) and _on_cpu(model) and self.backend != "nccl"
        ):
            try:
                self._connect_shared(model)
                return
            except WeightSyncError as exc:
                if wanted == "shared_memory":
                    raise
                logger.info("shared-memory weight sync unavailable (%s): broadcasting instead", exc)
        self._connect_broadcast(model)

    def _connect_shared(self, model: Any) -> None:
        from gymbridge.generation.shared_weights import SharedWeightsWriter

        if not _on_cpu(model):
            raise WeightSyncError("shared-memory weight sync needs the trainer's model on the CPU")
        specs = [
            TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for n, t in published_weights(model)
        ]
        writer = SharedWeightsWriter(specs)
        try:
            self._post(
                "/weights/init_group",
                {
                    "transport": "shared_memory",
                    "segments": writer.names,
                    "nonce": writer.nonce.hex(),
                    "tensors": [s.to_json() for s in specs],
                    **_lora_body(model),
                },
            )
        except BaseException:
            writer.close()
            raise
        writer.unlink()  # both sides hold their mappings: nothing stays in /dev/shm
        self._shared = writer
        self._next_segment = 0
        self._segment_versions: list[int | None] = [None, None]
        """The version last written into each segment (``None``: never written)."""
        self.transport = "shared_memory"
        logger.info(
            "shared-memory weight sync with %s ready (%.1f MiB per segment)", self.url, writer.nbytes / 2**20
        )

    def _connect_broadcast(self, model: Any) -> None:
        backend = self.backend or _default_backend(model)
        ranks = int(self.status().get("ranks", 1))
        world_size = 1 + ranks
        store = weight_store(self.host, 0, world_size=world_size, is_host=True, timeout_s=self.timeout_s)
        specs = [s for b in plan_buckets(published_weights(model), self.bucket_bytes) for s in b.specs]
        # the server joins in the background once the layout is checked (202); rank 0 joins here
        self._post(
            "/weights/init_group",
            {
                "host": self.host,
                "port": int(store.port),
                "rank_offset": 1,
                "world_size": world_size,
                "backend": backend,
                "timeout_s": self.timeout_s,
                "tensors": [s.to_json() for s in specs],
                **_lora_body(model),
            },
        )
        self._group = self._join(store, world_size, backend)
        self._store = store
        self.transport = "broadcast"
        logger.info("weight group with %s ready (%s, %d ranks)", self.url, backend, world_size)

    def _join(self, store: Any, world_size: int, backend: Backend) -> WeightGroup:
        """Join as rank 0 while watching the server: a server that fails to join is reported at once
        (its ``/weights/status`` error), not after ``timeout_s`` of waiting for it."""
        outcome: dict[str, Any] = {}

        def build() -> None:
            try:
                outcome["group"] = open_weight_group(
                    store, rank=0, world_size=world_size, backend=backend, timeout_s=self.timeout_s
                )
            except BaseException as exc:  # handed to the caller below
                outcome["error"] = exc

        thread = threading.Thread(target=build, name="gymbridge-weight-group", daemon=True)
        thread.start()
        while True:
            thread.join(0.25)
            if not thread.is_alive():
                break
            error = self.status().get("error")
            if error:
                raise WeightSyncError(f"the server at {self.url} could not join the weight group: {error}")
        if "error" in outcome:
            raise outcome["error"]
        group: WeightGroup = outcome["group"]
        return group

    # ------------------------------------------------------------------ publishing

    def publish(self, model: Any, version: int) -> float:
        started = time.perf_counter()
        if self.version is not None and version < self.version:
            raise WeightSyncError(f"policy version {version} is older than the published {self.version}")
        self.connect(model)
        named = published_weights(model)
        if self._vllm is not None:
            self._vllm.publish(model, version)
            self.last_timings = self._vllm.last_timings
        elif self._shared is not None:
            self._publish_shared(named, version, started)
        else:
            self._publish_broadcast(named, version, started)
        self.version = version
        self.syncs += 1
        self.last_bytes = _nbytes(named)
        self.last_sync_s = time.perf_counter() - started
        return self.last_sync_s

    def _publish_shared(self, named: list[tuple[str, torch.Tensor]], version: int, started: float) -> None:
        writer = self._shared
        segment = self._next_segment
        previous = self._segment_versions[1 - segment]
        if self._segment_versions[segment] is not None and previous is not None:
            # the generator may still read this segment: the swap away from it (the previous
            # publication) waits for the generation in flight to end, and so must this write
            self._wait_live(previous)
        writer.write(segment, [t for _, t in named])
        written = time.perf_counter()
        try:
            self._post(
                "/weights/update",
                {"version": version, "transport": "shared_memory", "segment": segment},
            )
        except WeightSyncError:
            # which segment the server uses is unknown now: set up afresh on the next publish
            self._drop_shared()
            raise
        self._segment_versions[segment] = version
        self._next_segment = 1 - segment
        self.last_timings = {"pack_send_s": written - started, "load_s": time.perf_counter() - written}

    def _wait_live(self, version: int) -> None:
        """Until the server's live ``policy_version`` is ``version`` or newer (``timeout_s`` at most)."""
        deadline = time.monotonic() + self.timeout_s
        while int(self.status().get("policy_version", -1)) < version:
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"policy version {version} did not go live on {self.url} within {self.timeout_s:g}s "
                    "(a generation running that long holds the segment the next version goes to)"
                )
            time.sleep(0.005)

    def _drop_shared(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None
            self.transport = None

    def _publish_broadcast(self, named: list[tuple[str, torch.Tensor]], version: int, started: float) -> None:
        group = self._group
        assert group is not None
        buckets = plan_buckets(
            named, self.bucket_bytes, alone_bytes=min(DEFAULT_ALONE_BYTES, self.bucket_bytes)
        )
        self._post("/weights/update", {"version": version, "buckets": [b.to_json() for b in buckets]})
        tensors = dict(named)
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        if self._buffers is None or self._buffers.device != device:
            self._buffers = BucketBuffers(self.bucket_bytes, device)
        works: list[Any] = []
        with torch.no_grad():
            for i, bucket in enumerate(buckets):
                entries = [tensors[s.name] for s in bucket.specs]
                flat = single_tensor(bucket, entries)
                if flat is None:
                    if len(works) >= 2:  # buffer i % 2 is free once bucket i - 2 is on its way
                        group.wait(works[-2])
                    flat = self._buffers.flat(i, bucket)
                    bucket_into(bucket, entries, flat)
                works.append(group.broadcast_async(flat, timeout_s=self.timeout_s))
            for work in works:
                group.wait(work)
        sent = time.perf_counter()
        self._wait_loaded(version)
        self.last_timings = {"pack_send_s": sent - started, "load_s": time.perf_counter() - sent}

    def _wait_loaded(self, version: int) -> None:
        key = loaded_key(version)
        try:
            self._store.wait([key])
            mark = bytes(self._store.get(key)).decode()
        except RuntimeError as exc:
            raise WeightSyncError(f"the server did not confirm policy version {version}: {exc}") from exc
        if mark != "ok":
            raise WeightSyncError(f"the server failed to load policy version {version}: {mark}")

    def close(self) -> None:
        if self._vllm is not None:
            self._vllm.close()
            self._vllm = None
        if self._group is not None:
            self._group.close()
            self._group = None
        self._store = None
        self._buffers = None
        self._drop_shared()
        self._http.close()
