"""Policy weights on the move: their layout, bounded buckets, and a private torch.distributed group.

Both ends of a weight sync use this module: the trainer (:mod:`gymbridge.trainer.weight_sync`)
sends, the model server (:class:`WeightReceiver`, behind its ``/weights/*`` routes) and vLLM
workers (:class:`~gymbridge.generation.vllm.WeightSyncWorkerExtension`) receive.

* **Layout.** A model's weights are its ``state_dict`` entries (parameters and persistent
  buffers) with aliases removed: two names over one storage (tied embeddings) are sent once,
  under the first name, and the receiver checks that every name it does not receive is an
  alias of one it does. A :class:`TensorSpec` (name, shape, dtype) describes one entry; both
  sides refuse a layout that does not match their own model with every mismatch listed.
* **Buckets.** Entries are packed, in state-dict order, into flat buffers of one dtype of at
  most ``bucket_bytes`` (default 64 MiB; an entry larger than that travels alone, and the
  trainer sends entries of at least ``DEFAULT_ALONE_BYTES`` alone too). A bucket of one
  contiguous entry is sent from, and received into, the tensor itself (no copy). No process
  ever holds the weights twice: the extra memory of a sync is two bucket buffers per side
  (:class:`BucketBuffers`, kept between syncs so their pages are not faulted in again), which
  lets packing bucket ``i + 1`` overlap the broadcast of bucket ``i`` on the sender, and
  unpacking ``i`` overlap receiving ``i + 1`` on the receiver.
* **The swap** ("pause at a generation boundary, swap, resume"). A publication lands in
  *staging* first, without the generator's :class:`WeightGate`, so the trainer's side (the
  broadcast every group member must enter) never waits for a running generate call. The
  receiver broadcasts straight into one flat staging tensor per bucket (kept between syncs for
  an unchanged plan): one extra copy of the published weights on the model's device, at most
  ``staging_bytes`` (:data:`DEFAULT_STAGING_BYTES`); a larger publication falls back to being
  received into the live model at a generation boundary, generation paused meanwhile. Then
  :meth:`WeightGate.stage` hands over the swap (a copy from staging, memcpy-bound, that also sets
  the version): at once when no generation runs, else when the running one ends; new
  generations wait while it is pending, so every generation, every token of it, runs on the one
  version it reports. The receiver's store mark ``ok`` means *staged*: any generation starting
  after it runs on that version; ``policy_version`` (and ``/weights/status``) is the live one.
* **The group.** :func:`open_weight_group` builds a two-member (or larger) process group from
  a ``TCPStore`` (:func:`weight_store`) directly (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA),
  without ``init_process_group``: torch's default group stays free for the trainer's own
  data parallelism, and the generator's process needs no global state either. Rank 0 (the
  trainer) hosts the store on 127.0.0.1 (or the address given) and is the broadcast root.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Protocol

import torch

from gymbridge.errors import WeightSyncError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_ALONE_BYTES",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_STAGING_BYTES",
    "Bucket",
    "BucketBuffers",
    "TensorSpec",
    "WeightGate",
    "WeightGroup",
    "WeightReceiver",
    "WeightSink",
    "WeightTarget",
    "bucket_from_bytes",
    "bucket_into",
    "bucket_tensors",
    "bucket_to_bytes",
    "check_layout",
    "dtype_from_name",
    "is_adapter_name",
    "loaded_key",
    "named_weights",
    "open_weight_group",
    "plan_buckets",
    "published_weights",
    "raise_on_problems",
    "single_tensor",
    "weight_gate",
    "weight_store",
]

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
"""64 MiB: large enough that per-collective latency is amortised, small enough to be an
afterthought next to the model's own memory."""
DEFAULT_ALONE_BYTES = 1024 * 1024
"""1 MiB: entries this large are broadcast on their own, straight from and into the tensors
(a collective's fixed cost is ~0.1 ms on loopback gloo, a 1 MiB copy about as much)."""
DEFAULT_STAGING_BYTES = 8 * 1024**3
"""8 GiB: the largest staged copy of a publication a generator keeps (a 4B-parameter model in
bf16); a larger one is copied into the live model at a generation boundary instead (module
docstring, "The swap")."""

Backend = Literal["gloo", "nccl"]
GROUP_NAME = "gymbridge-weights"

PUBLISHED_NAMES_ATTR = "gymbridge_published_names"
"""The model attribute naming what a LoRA model publishes (:func:`gymbridge.generation.lora.apply_lora`
sets it: a frozenset of state-dict names); absent, the whole model is published."""
ADAPTER_PATTERN = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.")


def is_adapter_name(name: str) -> bool:
    """Whether a state-dict name is a peft LoRA adapter tensor's (``x.lora_A.default.weight``)."""
    return ADAPTER_PATTERN.search(name) is not None


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One weight entry: its state-dict name, shape and dtype name (``"float32"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: Any) -> TensorSpec:
        if not isinstance(data, dict):
            raise WeightSyncError(f"a tensor spec must be an object, got {type(data).__name__}")
        name, shape, dtype = data.get("name"), data.get("shape"), data.get("dtype")
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise WeightSyncError(f"a tensor spec needs string 'name' and 'dtype': {data!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise WeightSyncError(f"tensor {name!r}: 'shape' must be a list of non-negative ints")
        dtype_from_name(dtype)
        return cls(name, tuple(shape), dtype)


@dataclass(frozen=True, slots=True)
class Bucket:
    """Consecutive entries of one dtype, sent as one flat buffer of ``numel`` elements."""

    dtype: str
    specs: tuple[TensorSpec, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "tensors": [s.to_json() for s in self.specs]}

    @classmethod
    def from_json(cls, data: Any) -> Bucket:
        if not isinstance(data, dict) or not isinstance(data.get("tensors"), list):
            raise WeightSyncError("a bucket must be an object with a 'tensors' list")
        dtype = data.get("dtype")
        specs = tuple(TensorSpec.from_json(t) for t in data["tensors"])
        if not isinstance(dtype, str) or any(s.dtype != dtype for s in specs):
            raise WeightSyncError(f"a bucket's tensors must all be of its dtype {dtype!r}")
        return cls(dtype, specs)


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; anything that is not a torch dtype is refused."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"{name!r} is not a torch dtype")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def named_weights(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The model's state-dict entries with aliases removed (first name wins), in state-dict order.

    The tensors are the model's own (no copy): ``state_dict`` returns detached references.
    """
    seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in model.state_dict().items():
        if not isinstance(tensor, torch.Tensor):
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


def published_weights(model: Any) -> list[tuple[str, torch.Tensor]]:
    """What a publication sends of ``model``: :func:`named_weights`, less what a LoRA model never
    changes (only the names in its :data:`PUBLISHED_NAMES_ATTR`: adapters and fully trained tensors)."""
    named = named_weights(model)
    keep = getattr(model, PUBLISHED_NAMES_ATTR, None)
    if not isinstance(keep, frozenset):
        return named
    return [(n, t) for n, t in named if n in keep]


def plan_buckets(
    named: Sequence[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    alone_bytes: int | None = None,
) -> list[Bucket]:
    """Pack ``named`` into buckets: one dtype each, at most ``bucket_bytes`` unless one entry is larger.

    Order is kept within a dtype; a bucket closes when the next entry would overflow it or
    has another dtype. ``alone_bytes``: an entry of at least that many bytes gets a bucket of
    its own (sent from and received into the tensor itself, no packing copy on either side).
    """
    if bucket_bytes < 1:
        raise ValueError("bucket_bytes must be >= 1")
    buckets: list[Bucket] = []
    open_by_dtype: dict[str, tuple[list[TensorSpec], int]] = {}
    for name, tensor in named:
        spec = TensorSpec(name, tuple(tensor.shape), _dtype_name(tensor.dtype))
        size = tensor.numel() * tensor.element_size()
        specs, used = open_by_dtype.get(spec.dtype, ([], 0))
        if alone_bytes is not None and size >= alone_bytes:
            if specs:  # closed first: the order within a dtype is kept
                buckets.append(Bucket(spec.dtype, tuple(specs)))
                open_by_dtype[spec.dtype] = ([], 0)
            buckets.append(Bucket(spec.dtype, (spec,)))
            continue
        if specs and used + size > bucket_bytes:
            buckets.append(Bucket(spec.dtype, tuple(specs)))
            specs, used = [], 0
        specs.append(spec)
        open_by_dtype[spec.dtype] = (specs, used + size)
    buckets.extend(Bucket(dtype, tuple(specs)) for dtype, (specs, _) in open_by_dtype.items() if specs)
    return buckets


def check_layout(specs: Sequence[TensorSpec], model: Any, *, partial: bool = False) -> list[str]:
    """Every way ``specs`` (what a sender has) disagree with ``model`` (the receiver); ``[]`` if none.

    Names unknown to ``model``, shape or dtype differences, and entries of ``model`` that no
    spec updates (unless they alias an updated one) are all listed. ``partial`` (a LoRA
    publication): entries never sent are fine, except adapter tensors (:func:`is_adapter_name`):
    every adapter of the receiver must be sent, or it would serve a stale one.
    """
    own = dict(model.state_dict())
    problems: list[str] = []
    sent: set[str] = set()
    for spec in specs:
        if spec.name in sent:
            problems.append(f"{spec.name}: sent twice")
            continue
        sent.add(spec.name)
        target = own.get(spec.name)
        if target is None:
            problems.append(f"{spec.name}: not a weight of the receiving model")
            continue
        if tuple(target.shape) != spec.shape:
            problems.append(f"{spec.name}: shape {list(spec.shape)} sent, {list(target.shape)} here")
        if _dtype_name(target.dtype) != spec.dtype:
            problems.append(f"{spec.name}: dtype {spec.dtype} sent, {_dtype_name(target.dtype)} here")
    updated = {own[n].data_ptr() for n in sent if n in own and own[n].numel()}
    for name, tensor in own.items():
        if partial and not is_adapter_name(name):
            continue
        if name not in sent and tensor.numel() and tensor.data_ptr() not in updated:
            problems.append(f"{name}: a weight of the receiving model that is never sent")
    return problems


# ----------------------------------------------------------------------------- the group


class WeightGroup:
    """A private process group for weight broadcasts (see the module docstring); rank 0 is the root."""

    def __init__(self, store: Any, backend_group: Any, rank: int, world_size: int, backend: Backend) -> None:
        self._store = store  # keeps the TCPStore (and, on rank 0, its server) alive
        self._group = backend_group
        self.rank = rank
        self.world_size = world_size
        self.backend: Backend = backend

    def broadcast(self, tensor: torch.Tensor, *, timeout_s: float | None = None) -> None:
        """Broadcast ``tensor`` in place from rank 0 to every member (blocking)."""
        self.wait(self.broadcast_async(tensor, timeout_s=timeout_s))

    def broadcast_async(self, tensor: torch.Tensor, *, timeout_s: float | None = None) -> Any:
        """Start broadcasting ``tensor`` in place from rank 0; :meth:`wait` on the returned work.

        ``tensor`` must stay untouched until then. Members must start broadcasts in the same order.
        """
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        if timeout_s is not None:
            opts.timeout = timedelta(seconds=timeout_s)
        try:
            return self._group.broadcast([tensor], opts)
        except RuntimeError as exc:
            raise WeightSyncError(f"weight broadcast failed on rank {self.rank}: {exc}") from exc

    def wait(self, work: Any) -> None:
        """Wait for a :meth:`broadcast_async`; a failure is :class:`WeightSyncError`."""
        try:
            work.wait()
        except RuntimeError as exc:
            raise WeightSyncError(f"weight broadcast failed on rank {self.rank}: {exc}") from exc

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            abort = getattr(group, "abort", None) or getattr(group, "shutdown", None)
            if callable(abort):
                try:
                    abort()
                except RuntimeError:  # already torn down by the peer
                    logger.debug("weight group abort failed", exc_info=True)
        self._store = None


def weight_store(host: str, port: int, *, world_size: int, is_host: bool, timeout_s: float = 120.0) -> Any:
    """The ``TCPStore`` a weight group meets at: hosted by rank 0 (``port=0``: a free port, read
    ``.port``), joined as a client by every other member (and by the model server's own process).

    The host listens on ``host`` alone (torch's own store would listen on every interface): a run on
    one machine exposes nothing beyond loopback."""
    import socket

    from torch._C._distributed_c10d import TCPStore

    try:
        listen_fd = None
        if is_host:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listen_fd = socket.create_server((host, port), family=family).detach()
        return TCPStore(
            host,
            port,
            world_size,
            is_master=is_host,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
    except (RuntimeError, ValueError) as exc:  # DistStoreError / DistNetworkError are RuntimeErrors
        raise WeightSyncError(
            f"could not {'host' if is_host else 'reach'} the weight store at {host}:{port}: {exc}"
        ) from exc


def open_weight_group(
    store: Any,
    *,
    rank: int,
    world_size: int,
    backend: Backend,
    timeout_s: float = 120.0,
    group_name: str = GROUP_NAME,
) -> WeightGroup:
    """Join the weight group meeting at ``store`` as ``rank``; blocks until every member joined.

    ``timeout_s`` bounds the wait (and every later collective): :class:`WeightSyncError`.
    """
    from torch._C._distributed_c10d import PrefixStore

    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size}: need 0 <= rank < world_size >= 2")
    timeout = timedelta(seconds=timeout_s)
    prefixed = PrefixStore(group_name, store)
    try:
        if backend == "nccl":
            from torch._C._distributed_c10d import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = timeout
            group: Any = ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            from torch._C._distributed_c10d import ProcessGroupGloo

            group = ProcessGroupGloo(prefixed, rank, world_size, timeout)
    except (RuntimeError, ValueError, ImportError) as exc:
        raise WeightSyncError(
            f"could not join the weight group as rank {rank}/{world_size} ({backend}): {exc}"
        ) from exc
    return WeightGroup(store, group, rank, world_size, backend)


def loaded_key(version: int) -> str:
    """The store key a receiver sets (to ``ok`` or ``error: ...``) once ``version`` is loaded."""
    return f"{GROUP_NAME}/loaded/{version}"


def bucket_tensors(bucket: Bucket, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One flat ``[numel]`` buffer holding ``tensors`` (the bucket's entries) back to back."""
    flat = torch.empty(bucket.numel, dtype=dtype_from_name(bucket.dtype), device=device)
    bucket_into(bucket, tensors, flat)
    return flat


def bucket_into(bucket: Bucket, tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``tensors`` (the bucket's entries) back to back into ``flat`` (``[bucket.numel]``)."""
    offset = 0
    for spec, tensor in zip(bucket.specs, tensors, strict=True):
        n = spec.numel
        flat[offset : offset + n].view(tensor.shape).copy_(tensor.detach())
        offset += n


class BucketBuffers:
    """Two reusable flat byte buffers of ``bucket_bytes`` on ``device`` (see the module docstring).

    :meth:`flat` hands out buffer ``i % 2`` viewed as a bucket's dtype and length; a bucket
    larger than the buffers gets a buffer of its own for that one use.
    """

    def __init__(self, bucket_bytes: int, device: torch.device) -> None:
        self.bucket_bytes = bucket_bytes
        self.device = device
        self._raw: list[torch.Tensor | None] = [None, None]

    def flat(self, i: int, bucket: Bucket) -> torch.Tensor:
        dtype = dtype_from_name(bucket.dtype)
        nbytes = bucket.numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.bucket_bytes:
            return torch.empty(bucket.numel, dtype=dtype, device=self.device)
        raw = self._raw[i % 2]
        if raw is None:
            raw = self._raw[i % 2] = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
        return raw[:nbytes].view(dtype)


def single_tensor(bucket: Bucket, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensor itself when ``bucket`` is one contiguous entry (sent / received with no copy)."""
    if len(bucket.specs) != 1 or not tensors[0].is_contiguous():
        return None
    return tensors[0].detach().view(-1)


def bucket_to_bytes(flat: torch.Tensor) -> bytes:
    """A bucket's flat buffer as raw bytes (its dtype's native layout), for a channel that carries
    only plain values: vLLM's ``collective_rpc`` arguments (msgpack) turn tensors into lists."""
    return bytes(flat.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def bucket_from_bytes(bucket: Bucket, payload: bytes | bytearray | memoryview) -> torch.Tensor:
    """The flat ``[numel]`` buffer of ``bucket`` from :func:`bucket_to_bytes`'s bytes (a CPU copy).

    A payload whose size is not ``numel`` elements of the bucket's dtype is refused
    (:class:`WeightSyncError`), so a truncated or mismatched message never loads.
    """
    dtype = dtype_from_name(bucket.dtype)
    expected = bucket.numel * torch.empty((), dtype=dtype).element_size()
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise WeightSyncError(f"a bucket's payload must be bytes, got {type(payload).__name__}")
    if len(payload) != expected:
        raise WeightSyncError(
            f"a {bucket.dtype} bucket of {bucket.numel} elements needs {expected} bytes, got {len(payload)}"
        )
    if expected == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(payload), dtype=dtype)


def unbucket(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """The bucket's entries as views of ``flat``, in order."""
    offset = 0
    for spec in bucket.specs:
        yield spec, flat[offset : offset + spec.numel].view(spec.shape)
        offset += spec.numel


# ----------------------------------------------------------------------------- the receiver


def _model_device(model: Any) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


class WeightGate:
    """Who uses a generator's weights, and when new ones go in (module docstring, "The swap").

    ``with gate:`` is one *use* (a generate or scoring call, an in-place change of the model): it
    waits while another use runs or a swap is pending, one use at a time. :meth:`stage` hands over
    a swap (a callable that copies staged weights into the model and sets its version): applied
    at once when no use runs, else by the running use as it ends, before any other starts; it
    never waits for a use. Its ``with`` is a lock's, so a target whose ``weights_lock`` is a plain
    ``threading.Lock`` still works (its swaps then wait for the lock).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_use = False
        self._held = False
        """A staged swap was dropped for restaging: uses wait for the next :meth:`stage`."""
        self._pending: tuple[int, Callable[[], None]] | None = None

    @property
    def pending_version(self) -> int | None:
        """The version staged and not live yet (``None``: none)."""
        pending = self._pending
        return pending[0] if pending is not None else None

    def __enter__(self) -> WeightGate:
        with self._cond:
            self._cond.wait_for(lambda: not self._in_use and not self._held)
            self._in_use = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._cond:
            try:
                self._apply(raise_errors=False)
            finally:
                self._in_use = False
                self._cond.notify_all()

    def stage(self, version: int, swap: Callable[[], None]) -> None:
        """Make ``swap`` (which loads ``version``) the next change to the weights: now when no use
        runs (an error raises here), else as the running use ends (an error is logged, the live
        version stays). A swap still pending is replaced: its version never goes live."""
        with self._cond:
            self._pending = (version, swap)
            self._held = False
            try:
                if not self._in_use:
                    self._apply(raise_errors=True)
            finally:
                self._cond.notify_all()

    def unstage(self, *, hold: bool = False) -> None:
        """Drop a swap not applied yet, before its staging is overwritten (a swap being applied
        finishes first). ``hold``: if one was dropped, uses wait until the next :meth:`stage` or
        :meth:`release`, so that none starts on weights older than the dropped version."""
        with self._cond:
            if self._pending is not None:
                self._pending = None
                self._held = hold

    def release(self) -> None:
        """Let uses start again after ``unstage(hold=True)`` (the restaging failed)."""
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def _apply(self, *, raise_errors: bool) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        version, swap = pending
        try:
            swap()
        except Exception:
            if raise_errors:
                raise
            logger.exception("staged policy version %d could not be swapped in", version)


class WeightTarget(Protocol):
    """A generator whose model a receiver can overwrite: ``HFGenerator`` is one."""

    model: Any
    policy_version: int
    """The version of the weights live in :attr:`model`."""

    @property
    def weights_lock(self) -> WeightGate | threading.Lock: ...


def weight_gate(target: WeightTarget) -> WeightGate | None:
    """``target``'s :class:`WeightGate`; ``None`` for a plain lock (no staging: swaps wait for it)."""
    lock = target.weights_lock
    return lock if isinstance(lock, WeightGate) else None


class WeightSink(Protocol):
    """What the model server's ``/weights/*`` routes drive: one per served generator.

    ``ranks`` is how many group members the generator brings (1 for an in-memory model, one per
    worker for vLLM). :meth:`check` refuses a layout before anything moves; :meth:`join` and
    :meth:`receive` may block for as long as the trainer takes, so the server runs them as tasks.
    """

    ranks: int

    @property
    def policy_version(self) -> int: ...

    def check(self, specs: Sequence[TensorSpec]) -> None: ...

    async def join(
        self, *, host: str, port: int, rank_offset: int, world_size: int, backend: Backend, timeout_s: float
    ) -> None: ...

    async def receive(self, version: int, buckets: Sequence[Bucket], *, timeout_s: float) -> float: ...

    def mark_loaded(self, version: int, outcome: str) -> None: ...

    def close(self) -> None: ...


class WeightReceiver:
    """The generator side of a weight sync for an in-memory model (``HFGenerator``): a :class:`WeightSink`.

    :meth:`join` joins the trainer's group; :meth:`receive` takes one version's buckets into
    staging while generation goes on, then stages the swap with the generator's
    :class:`WeightGate` (module docstring, "The swap"): no generation runs on half-updated weights
    and a generation's ``policy_version`` is the version of the weights it ran on. A target
    without a gate (a plain lock), or a publication over ``staging_bytes``, is received into the
    live model under the lock instead (generation waits for the length of that sync).
    :attr:`policy_version` is the live version, :attr:`pending_version` one staged behind a
    running generation.
    """

    ranks = 1

    def __init__(
        self,
        target: WeightTarget,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        self.target = target
        self.bucket_bytes = bucket_bytes
        self.staging_bytes = staging_bytes
        self.group: WeightGroup | None = None
        self._store: Any = None
        self._buffers: BucketBuffers | None = None
        self._staging: tuple[tuple[Bucket, ...], list[torch.Tensor]] | None = None
        """The staging of the last bucket plan: one flat tensor per bucket."""
        self._shared: Any = None
        """The :class:`~gymbridge.generation.shared_weights.SharedWeightsReader` (shared-memory sync)."""
        self._shared_groups: list[list[torch.Tensor]] = []
        """Per shared spec: every tensor object of the model over its storage (aliases included)."""
        self.transport = "broadcast"
        self.lora: dict[str, Any] | None = None
        """The trainer's adapter settings (:meth:`prepare_lora`): only published tensors arrive."""

    @property
    def policy_version(self) -> int:
        """The version live in the model (what ``/weights/status`` reports)."""
        return self.target.policy_version

    @property
    def pending_version(self) -> int | None:
        """A version received and waiting for the running generation to end (``None``: none)."""
        gate = weight_gate(self.target)
        return gate.pending_version if gate is not None else None

    def prepare_lora(self, settings: dict[str, Any] | None) -> None:
        """Take the trainer's LoRA settings (``None``: a full-weight trainer). A model without adapters
        gets them injected (:func:`gymbridge.generation.lora.apply_lora`, the same modules and rank);
        one holding other adapters is refused (:class:`WeightSyncError`)."""
        from gymbridge.generation.lora import apply_lora, lora_settings

        if settings is None:
            if lora_settings(self.target.model) is not None:
                raise WeightSyncError("this model holds LoRA adapters; the trainer publishes full weights")
            self.lora = None
            return
        held = lora_settings(self.target.model)
        wanted = {k: v for k, v in settings.items() if k != "vision"}
        if held is None:
            with self.target.weights_lock:
                apply_lora(self.target.model, settings)
        elif {k: v for k, v in held.items() if k != "vision"} != wanted:
            raise WeightSyncError(
                f"this model holds other LoRA adapters ({held}) than the trainer's ({settings})"
            )
        self.lora = dict(settings)

    def check(self, specs: Sequence[TensorSpec]) -> None:
        raise_on_problems(check_layout(specs, self.target.model, partial=self.lora is not None))

    async def join(
        self, *, host: str, port: int, rank_offset: int, world_size: int, backend: Backend, timeout_s: float
    ) -> None:
        await asyncio.to_thread(self._join, host, port, rank_offset, world_size, backend, timeout_s)

    def _join(
        self, host: str, port: int, rank: int, world_size: int, backend: Backend, timeout_s: float
    ) -> None:
        self.close()
        device = _model_device(self.target.model)
        self._buffers = BucketBuffers(self.bucket_bytes, device)
        if backend == "nccl" and device.type != "cuda":
            raise WeightSyncError(f"an nccl weight group needs the model on a GPU; it is on {device}")
        store = weight_store(host, port, world_size=world_size, is_host=False, timeout_s=timeout_s)
        self.group = open_weight_group(
            store, rank=rank, world_size=world_size, backend=backend, timeout_s=timeout_s
        )
        self._store = store

    async def receive(self, version: int, buckets: Sequence[Bucket], *, timeout_s: float) -> float:
        return await asyncio.to_thread(self.receive_sync, version, buckets, timeout_s)

    def receive_sync(self, version: int, buckets: Sequence[Bucket], timeout_s: float | None = None) -> float:
        """Receive ``buckets`` and stage them as ``version`` (live now when no generation runs, else
        when the running one ends); returns the seconds it took."""
        group = self.group
        if group is None:
            raise WeightSyncError("no weight group: POST /weights/init_group first")
        started = time.perf_counter()
        device = _model_device(self.target.model)
        gate = weight_gate(self.target)
        nbytes = sum(b.numel * dtype_from_name(b.dtype).itemsize for b in buckets)
        if gate is not None and nbytes <= self.staging_bytes:
            self._receive_staged(gate, group, version, buckets, device, timeout_s)
        else:
            if gate is not None:
                logger.info(
                    "policy version %d: %.1f MiB is over the staging bound (%.1f MiB): received into "
                    "the live model at a generation boundary",
                    version,
                    nbytes / 2**20,
                    self.staging_bytes / 2**20,
                )
            self._receive_live(group, version, buckets, device, timeout_s)
        elapsed = time.perf_counter() - started
        logger.info(
            "received policy version %d (%d buckets) in %.3fs; live: %d",
            version,
            len(buckets),
            elapsed,
            self.target.policy_version,
        )
        return elapsed

    def _receive_staged(
        self,
        gate: WeightGate,
        group: WeightGroup,
        version: int,
        buckets: Sequence[Bucket],
        device: torch.device,
        timeout_s: float | None,
    ) -> None:
        """Broadcast straight into the staging (no generation waits), then stage the swap."""
        plan = tuple(buckets)
        # a swap still pending reads this staging: dropped, and generations wait for this version
        gate.unstage(hold=True)
        try:
            if self._staging is None or self._staging[0] != plan:
                self._staging = None  # the old staging is freed before the new one is made
                flats = [torch.empty(b.numel, dtype=dtype_from_name(b.dtype), device=device) for b in plan]
                self._staging = (plan, flats)
            flats = self._staging[1]
            works = [group.broadcast_async(flat, timeout_s=timeout_s) for flat in flats]
            for work in works:
                group.wait(work)
        except BaseException:
            gate.release()
            raise
        target = self.target

        def swap() -> None:
            own = dict(target.model.state_dict())
            with torch.no_grad():
                for bucket, flat in zip(plan, flats, strict=True):
                    for spec, view in unbucket(bucket, flat):
                        own[spec.name].copy_(view)
            target.policy_version = version

        gate.stage(version, swap)

    def _receive_live(
        self,
        group: WeightGroup,
        version: int,
        buckets: Sequence[Bucket],
        device: torch.device,
        timeout_s: float | None,
    ) -> None:
        """Receive into the model itself under the weights lock (the fallback: see the class docstring)."""
        own = dict(self.target.model.state_dict())
        buffers = self._buffers or BucketBuffers(self.bucket_bytes, device)
        # bucket i + 1 is received while bucket i is unpacked (two buffers); a one-entry bucket is
        # received straight into the model's tensor (the lock keeps every generation out meanwhile)
        pending: tuple[Any, Bucket, torch.Tensor | None] | None = None
        with self.target.weights_lock, torch.no_grad():
            for i, bucket in enumerate(buckets):
                direct = single_tensor(bucket, [own[s.name] for s in bucket.specs])
                flat = direct if direct is not None else buffers.flat(i, bucket)
                work = group.broadcast_async(flat, timeout_s=timeout_s)
                if pending is not None:
                    self._finish(group, own, *pending)
                pending = (work, bucket, None if direct is not None else flat)
            if pending is not None:
                self._finish(group, own, *pending)
            self.target.policy_version = version

    @staticmethod
    def _finish(
        group: WeightGroup, own: dict[str, torch.Tensor], work: Any, bucket: Bucket, flat: torch.Tensor | None
    ) -> None:
        group.wait(work)
        if flat is not None:
            for spec, view in unbucket(bucket, flat):
                own[spec.name].copy_(view)

    # ------------------------------------------------------------------ shared memory

    def attach_shared(self, names: Sequence[str], nonce: bytes, specs: Sequence[TensorSpec]) -> None:
        """Map the trainer's two segments (:mod:`~gymbridge.generation.shared_weights`); nothing
        is swapped yet. Refused for a model off the CPU and for a segment failing the handshake."""
        from gymbridge.generation.shared_weights import SharedWeightsReader

        raise_on_problems(check_layout(specs, self.target.model, partial=self.lora is not None))
        device = _model_device(self.target.model)
        if device.type != "cpu":
            raise WeightSyncError(f"shared-memory weight sync needs the model on the CPU; it is on {device}")
        reader = SharedWeightsReader(names, nonce, specs)
        with self.target.weights_lock:
            self.close()
            by_storage: dict[tuple[int, tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
            model = self.target.model
            for _, tensor in [
                *model.named_parameters(remove_duplicate=False),
                *model.named_buffers(remove_duplicate=False),
            ]:
                key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
                same = by_storage.setdefault(key, [])
                if not any(t is tensor for t in same):
                    same.append(tensor)
            own = dict(model.state_dict())
            groups = []
            for spec in specs:
                t = own[spec.name]
                found = by_storage.get((t.data_ptr(), tuple(t.shape), t.dtype))
                if not found:
                    reader.close()
                    raise WeightSyncError(f"{spec.name}: not a parameter or buffer of the model")
                groups.append(found)
            self._shared = reader
            self._shared_groups = groups
            self.transport = "shared_memory"

    def swap_shared(self, version: int, segment: int) -> float:
        """Stage pointing the model's weights at ``segment`` (0 or 1) as ``version``: live now when no
        generation runs, else when the running one ends (the segment is the staging: the trainer
        writes a segment only once the swap away from it is live); returns seconds."""
        reader = self._shared
        if reader is None:
            raise WeightSyncError("no shared-memory segments: POST /weights/init_group with them first")
        if segment not in (0, 1):
            raise WeightSyncError(f"segment must be 0 or 1, got {segment!r}")
        started = time.perf_counter()
        views, groups, target = reader.views[segment], self._shared_groups, self.target

        def swap() -> None:
            for view, tensors in zip(views, groups, strict=True):
                for tensor in tensors:
                    tensor.data = view
            target.policy_version = version

        gate = weight_gate(target)
        if gate is not None:
            gate.stage(version, swap)
        else:
            with target.weights_lock:
                swap()
        elapsed = time.perf_counter() - started
        logger.info(
            "staged policy version %d from shared memory in %.4fs; live: %d",
            version,
            elapsed,
            target.policy_version,
        )
        return elapsed

    def _detach_shared(self) -> None:
        """Give the model private copies of its weights again (before another transport writes them)."""
        if self._shared is None:
            return
        with torch.no_grad():
            for tensors in self._shared_groups:
                private = tensors[0].data.clone()
                for tensor in tensors:
                    tensor.data = private
        self._shared = None  # the mappings go once no tensor views them
        self._shared_groups = []
        self.transport = "broadcast"

    def mark_loaded(self, version: int, outcome: str) -> None:
        """Tell the trainer (through the group's store) that ``version`` is staged (``ok``: every
        generation starting from now on runs on it) or failed."""
        if self._store is not None:
            self._store.set(loaded_key(version), outcome)

    def close(self) -> None:
        gate = weight_gate(self.target)
        if gate is not None:  # a swap still pending reads what is released here
            gate.unstage()
            gate.release()
        if self.group is not None:
            self.group.close()
            self.group = None
        self._store = None
        self._buffers = None
        self._staging = None
        self._detach_shared()


def raise_on_problems(problems: Sequence[str]) -> None:
    """:class:`WeightSyncError` listing the first layout problems, if there are any."""
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... ({len(problems)} in all)" if len(problems) > 8 else "")
        raise WeightSyncError(f"the trainer's weights do not match this model: {shown}")
