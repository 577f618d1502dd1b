"""Data-parallel GRPO: Ray actors in one torch.distributed group, gradients reduced inside it.

:class:`RayDPTrainer` (the driver's side) runs ``num_workers`` :class:`DPWorker` actors, each with a
policy copy from ``model_factory``, in **one** ``torch.distributed`` group (gloo on CPU, NCCL when
the actors hold a GPU), separate from the weight-sync group of :mod:`gymbridge.trainer.weight_sync`.
:func:`init_ray` starts a local Ray or joins a cluster; Ray is imported lazily (a missing ``ray``
raises ``ImportError`` naming the ``ray`` extra).

A step: the driver shards the batch (``batch.shard``: whole groups where possible, balanced by
tokens; floating media cast to the policy's dtype) and sends each worker its shard; each worker
accumulates its gradients with ``GRPOTrainer.compute_gradients`` and all-reduces them once, in
bounded buckets; the driver runs the drift guard on the returned metrics; then every worker clips
and steps its own AdamW, and rank 0 alone returns its weights, which the driver loads and publishes.

Invariants:

* the shards' gradients sum to the full-batch gradient (every worker divides by the whole batch's
  normaliser), so ``dp_workers`` 0, 1 and 2 train the same step;
* the driver never holds a gradient; it receives metrics, and rank 0's weights once per step;
* every worker holds the same weights after a step (:meth:`RayDPTrainer.param_digests` checks it);
* a drifted step raises :class:`~gymbridge.errors.PolicyDriftError` before any worker moves, and
  a worker whose shard fails tells its peers before the reduction, so nobody waits on a collective
  that never comes.

``strategy="fsdp"`` runs :class:`FSDPWorker` actors instead: each builds the policy on the meta
device, shards it (:func:`gymbridge.trainer.sharding.shard_model`: FSDP2 per ``_no_split_modules``
block, fp32 masters with bf16 compute when the trainer's dtype is bfloat16) and loads only its shard
of the driver's weights (rank 0 receives them and broadcasts); its AdamW holds only its shards'
state. Gradients accumulate with ``loss.backward()`` and FSDP reduce-scatters (sums) them inside the
backward, so every rank must run the same forward and backward passes: before the first forward the
ranks check their micro-batches (placeholders, media keys), exchange a failure flag and each
micro-batch's media signature, and a rank with fewer passes of a signature runs zero-weighted
repeats of one of its own (:func:`lockstep_plan`; a repeat may be a micro-batch with some or all of
its media stripped). So that every rank has something to repeat, the driver gives a shard with no
row of a modality the batch holds one masked row of it, copied from a peer's shard
(:func:`lockstep_shards`). A failure after that point (a forward
that raises on one rank only) leaves its peers waiting until the group's ``timeout_s``. After the
step the weights reach the driver in buckets of at most ``bucket_bytes``: per bucket every rank
copies its rows of the bucket's parameters into one flat buffer and one ``gather`` brings the
buffers to rank 0, which returns them (numpy, out of band through Ray); the driver copies each
rank's rows into its policy while the ranks gather the next bucket, so no process holds more than
two buckets, never a second whole model.

With LoRA (the driver's policy holds adapters: :func:`gymbridge.generation.lora.apply_lora`) every
worker injects the same adapters into its fresh model before the driver's weights load (an FSDP
worker on the meta device, before sharding, so each adapter is sharded in its layer's unit beside
the frozen base weights); only the adapters train, the KL reference is the policy with its adapters
off (no reference model on any rank), and after a step only the published tensors
(:func:`gymbridge.generation.lora.published_names`) come back to the driver: its base weights never
change after setup.

The step in detail and why replicate is an explicit all-reduce rather than DDP: docs/dp.md.
"""

from __future__ import annotations

import atexit
import hashlib
import ipaddress
import logging
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from gymbridge.errors import PolicyDriftError, TrainingError
from gymbridge.generation.lora import apply_lora, lora_settings, published_names
from gymbridge.trainer.grpo import (
    GradientResult,
    GRPOConfig,
    GRPOTrainer,
    StepMetrics,
    log_skipped_step,
    loss_rows,
    skip_reason,
    summarize,
)

if TYPE_CHECKING:
    from gymbridge.metrics import PayloadMeter
    from gymbridge.tensors import TrainBatch
    from gymbridge.trainer.sharding import GatheredBucket

logger = logging.getLogger(__name__)

__all__ = [
    "DPStrategy",
    "DPWorker",
    "FSDPWorker",
    "RayDPTrainer",
    "Signature",
    "fsdp_load_states",
    "init_ray",
    "lockstep_plan",
    "lockstep_shards",
    "param_digest",
    "policy_shards",
    "require_ray",
]

DPStrategy = Literal["replicate", "fsdp"]

REDUCE_BUCKET_BYTES = 64 << 20
"""Largest flat buffer one gradient all-reduce moves."""

PUBLISH_BUCKET_BYTES = 64 << 20
"""Default largest bucket of full tensors one FSDP publication call returns to the driver."""


def require_ray() -> Any:
    """Import Ray or raise an ``ImportError`` that names the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "data-parallel training needs Ray, which is not installed: install the extra with "
            "pip install 'gymbridge[ray]'"
        ) from exc
    return ray


RAY_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""How a user chooses a Ray cluster's auth; a local run that finds any of them keeps it as given."""

_ray_token_path: Path | None = None


def _process_ray_token() -> Path:
    """This process's Ray token file: 256 random bits, mode 0600 in a 0700 temp dir, removed at exit.

    One per process rather than per ``ray.init``: Ray caches the token its driver first read, so a
    second local cluster in the same process must take the same one.
    """
    global _ray_token_path
    if _ray_token_path is None:
        folder = Path(tempfile.mkdtemp(prefix="gymbridge-ray-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        path = folder / "auth_token"
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        _ray_token_path = path
    return _ray_token_path


def _is_loopback(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` or their IPv4-mapped forms (how a dual-stack socket reports them)."""
    ip = ipaddress.ip_address(host)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


def _start_local_ray(ray: Any, num_cpus: int) -> None:
    """A one-node Ray whose every process listens on 127.0.0.1, with token auth on.

    Ray binds its gRPC servers (GCS, raylet, object manager, workers) and agents (dashboard,
    runtime env, metrics export) to the node's address, loopback only when that address is
    ``127.0.0.1``; ``ray.init`` turns ``127.0.0.1`` into the machine's outward address unless it
    believes multi-node clusters are off, a flag it reads from the environment at import, so it is
    switched off for the ``ray.init`` call only. Token auth: Ray turns it on for a new local cluster
    (``RAY_AUTH_MODE=token``); the token is this process's (:func:`_process_ray_token`), passed by
    path, so it is in no argv, log or run directory. Whatever the user set of
    :data:`RAY_AUTH_ENV` is kept as it is.
    """
    if not any(name in os.environ for name in RAY_AUTH_ENV):
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(_process_ray_token())
    # the workers' gloo pairs listen on the address of the host name unless given an interface
    loopback = "lo0" if sys.platform == "darwin" else "lo"
    worker_env = {} if "GLOO_SOCKET_IFNAME" in os.environ else {"GLOO_SOCKET_IFNAME": loopback}
    constants = ray._private.ray_constants
    multi_node = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": worker_env},
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    finally:
        constants.ENABLE_RAY_CLUSTER = multi_node
    node_ip = str(ray.util.get_node_ip_address()) if ray.is_initialized() else None
    if node_ip is not None and not _is_loopback(node_ip):  # fail closed if Ray changes its rules
        ray.shutdown()
        raise TrainingError(
            f"the local Ray ({ray.__version__}) took node address {node_ip}, not 127.0.0.1: it "
            "would listen on the network; set dp.ray_address to use a cluster you started"
        )
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        logger.warning(
            "Ray %s started the local cluster without token auth (RAY_AUTH_MODE=%s): any process "
            "of this machine can use it",
            ray.__version__,
            os.environ.get("RAY_AUTH_MODE", "unset"),
        )


def init_ray(num_cpus: int = 2, *, address: str | None = None) -> Any:
    """Start (or reuse) Ray and return ``ray``.

    ``address`` (a run's ``dp.ray_address``, e.g. ``"auto"`` or ``"ray://head:10001"``) joins an
    existing cluster with whatever auth the environment gives for it (nothing is turned off);
    without it a local Ray starts with ``num_cpus`` CPUs and no dashboard, listening on loopback
    only, with token auth (:func:`_start_local_ray`; docs/security.md, "Ray").
    """
    ray = require_ray()
    if not ray.is_initialized():
        if address is not None:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        else:
            _start_local_ray(ray, num_cpus)
    return ray


def param_digest(model: Any) -> str:
    """sha256 over every parameter's bytes, in ``named_parameters`` order."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _to_cpu(value: Any) -> Any:
    """``value`` (a state dict, nested) with every tensor on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def policy_shards(batch: TrainBatch, num_workers: int, dtype: torch.dtype) -> list[TrainBatch]:
    """What crosses to the workers: ``batch.shard(num_workers)`` with floating media cast to ``dtype``.

    ``batch`` itself is not changed (the Gym's return keeps its dtype).
    """
    return [s.cast_media(dtype) for s in batch.shard(num_workers, group_aware=True)]


LOCKSTEP_COPY = "lockstep_copy"
"""The metadata key marking a row :func:`lockstep_shards` added (a masked copy of a peer's row)."""


def _lockstep_copy(row: TrainBatch) -> TrainBatch:
    masked = row.without_loss()
    return replace(masked, metadata=tuple({**m, LOCKSTEP_COPY: True} for m in masked.metadata))


def lockstep_shards(shards: list[TrainBatch]) -> list[TrainBatch]:
    """``shards`` with masked rows added, so that every FSDP rank can run every pass a peer runs.

    For each modality some shard's rows hold, a shard without such a row gets a copy of the
    shortest row holding it (from another shard, its media with it) with ``without_loss`` and
    marked :data:`LOCKSTEP_COPY`; an empty shard of a batch without media gets the shortest row of
    the batch the same way. Added rows come after the shard's own; they train nothing, the worker
    runs them only as uncounted repeats, and the step's metrics read the whole batch, not the shards.
    """
    from gymbridge.tensors import TrainBatch

    rows = [{m: has for m, has in s.modality_rows().items() if bool(has.any())} for s in shards]
    modalities = sorted({m for r in rows for m in r})
    candidates = [(int(n), j, k) for j, s in enumerate(shards) for k, n in enumerate(s.lengths.tolist())]
    out = list(shards)
    for i, shard in enumerate(shards):
        picked: list[tuple[int, int]] = []
        held = set(rows[i])
        if not len(shard) and not modalities:
            _, j, k = min(candidates)
            picked.append((j, k))
        for m in modalities:
            if m in held:
                continue
            _, j, k = min(c for c in candidates if m in rows[c[1]] and bool(rows[c[1]][m][c[2]]))
            picked.append((j, k))
            held |= {mm for mm, has in rows[j].items() if bool(has[k])}
        if picked:
            added = [_lockstep_copy(shards[j].select([k])) for j, k in picked]
            out[i] = TrainBatch.cat([shard, *added]).trim() if len(shard) else TrainBatch.cat(added).trim()
    return out


class _GroupRank:
    """One rank of the DP group: joining it, leaving it."""

    rank: int
    world_size: int

    def node_address(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]  # ray ships it untyped

    def free_port(self, host: str) -> int:
        """A free TCP port on ``host`` for the group's store (rank 0 hosts it)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])

    def join(self, host: str, port: int, backend: str, timeout_s: float) -> str:
        """Join the DP group whose store rank 0 hosts at ``host:port``; returns the backend.

        Rank 0 listens on ``host`` alone (torch's own store would listen on every interface).
        """
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        listen_fd = None
        if self.rank == 0:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listen_fd = socket.create_server((host, port), family=family).detach()
        from torch._C._distributed_c10d import TCPStore

        store = TCPStore(
            host, port, self.world_size, self.rank == 0, timeout=timeout, master_listen_fd=listen_fd
        )
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )
        return str(dist.get_backend())

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _tensor_bytes(tensors: Any) -> int:
    return sum(int(t.numel() * t.element_size()) for t in tensors)


class DPWorker(_GroupRank):
    """The body of one Ray actor: a policy copy, its own trainer and optimizer, one rank of the group."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        model_factory: Callable[[], Any],
        config: GRPOConfig,
        dtype: torch.dtype,
        lora: dict[str, Any] | None = None,
    ) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        from gymbridge.trainer.memory import prepare_policy

        model = model_factory().to(device=self.device, dtype=dtype)
        _inject_lora(model, lora)  # the driver's adapters (their values come with load())
        # the driver's settings: frozen encoders, checkpointed blocks, bf16 autocast over fp32 masters
        prepare_policy(model, config, masters=True)
        self.trainer = GRPOTrainer(model, config)
        self._grads: list[torch.Tensor] | None = None

    # ------------------------------------------------------------------ state

    def load(self, state: dict[str, Any]) -> None:
        """Weights, optimizer state and step count (the driver's: at start and after a resume)."""
        self.trainer.model.load_state_dict(state["model"])
        if state["optimizer"]["state"]:
            self.trainer.optimizer.load_state_dict(state["optimizer"])
        else:  # a fresh driver optimizer: a fresh one here too (no momentum left from before)
            self.trainer = GRPOTrainer(self.trainer.model, self.trainer.config)
        self.trainer.steps = int(state["steps"])
        if state.get("reference") is not None and self.trainer.reference is not None:
            self.trainer.reference.load_state_dict(state["reference"])  # the driver's (a resumed run's)
        self._grads = None

    def optimizer_state(self) -> dict[str, Any]:
        return dict(_to_cpu(self.trainer.optimizer.state_dict()))

    def digest(self) -> str:
        return param_digest(self.trainer.model)

    def trainable_names(self) -> list[str]:
        """The names of the parameters this rank's optimizer updates, in its order."""
        return [n for n, p in self.trainer.model.named_parameters() if p.requires_grad]

    # ------------------------------------------------------------------ a step

    def compute(
        self, shard: TrainBatch, total_loss_tokens: int, total_loss_rows: int | None = None
    ) -> GradientResult | None:
        """This shard's gradients, all-reduced over the group; returns metrics only (no gradients).

        ``None``: a peer's shard failed (that worker raises); nothing is kept.
        """
        import torch.distributed as dist

        from gymbridge.generation.weights import bucket_tensors, plan_buckets, unbucket

        self._grads = None
        error: BaseException | None = None
        result: GradientResult | None = None
        try:
            result = self.trainer.compute_gradients(
                shard, total_loss_tokens=total_loss_tokens, total_loss_rows=total_loss_rows
            )
        except Exception as exc:  # told to the peers first, raised below
            error = exc
        failed = torch.tensor([0.0 if error is None else 1.0], device=self.device)
        dist.all_reduce(failed)
        if float(failed) > 0 or result is None:
            if error is not None:
                raise error
            return None
        grads = result.grads
        named = [(str(i), g) for i, g in enumerate(grads)]
        for bucket in plan_buckets(named, REDUCE_BUCKET_BYTES):
            flat = bucket_tensors(bucket, [grads[int(s.name)] for s in bucket.specs], self.device)
            dist.all_reduce(flat)
            for spec, view in unbucket(bucket, flat):
                grads[int(spec.name)].copy_(view)
        self._grads = grads
        return replace(result, grads=[])

    def discard(self) -> None:
        """Drop the reduced gradients (the driver's drift guard refused the step)."""
        self._grads = None

    def apply(self, send_weights: bool) -> tuple[float, dict[str, torch.Tensor] | None, dict[str, int]]:
        """Clip and step with the reduced gradients.

        Returns the pre-clip norm, the weights if asked, and this rank's resident state bytes.
        """
        if self._grads is None:
            raise TrainingError(f"DP worker {self.rank}: apply() without reduced gradients")
        grad_bytes = _tensor_bytes(self._grads)
        norm = self.trainer.apply_gradients(self._grads)
        self._grads = None
        weights = _published_state(self.trainer.model) if send_weights else None
        from gymbridge.trainer.sharding import resident_bytes

        held = resident_bytes(self.trainer.model, self.trainer.optimizer)
        return norm, weights, {**held.as_dict(), "grads": grad_bytes}


def _load_published(model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Copy rank 0's :func:`_published_state` into the driver's ``model`` (every name it publishes)."""
    keep = published_names(model)
    if keep is not None and set(weights) != keep:
        raise TrainingError(
            f"rank 0 sent {len(weights)} tensors, the driver's LoRA policy publishes {len(keep)}"
        )
    with torch.no_grad():
        model.load_state_dict(weights, strict=keep is None)


def _inject_lora(model: Any, settings: dict[str, Any] | None) -> None:
    """The driver's LoRA structure on a worker's fresh ``model`` (``settings``: :func:`lora_settings`
    of the driver's policy; ``None``: no adapters), before any weight is loaded, so names match."""
    if settings is None:
        return
    apply_lora(model, settings)


def _published_state(model: Any) -> dict[str, torch.Tensor]:
    """What rank 0 sends the driver after a step, on the CPU: the whole state dict, or with LoRA only
    :func:`~gymbridge.generation.lora.published_names` (the base never changes after setup)."""
    keep = published_names(model)
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if keep is None or k in keep}


class _PeerFailedError(Exception):
    """A peer's shard failed before the first forward (that peer raises its own error)."""


Signature = tuple[str, ...]
"""The modalities a micro-batch's forward encodes, sorted (``()``: text only)."""


def _media_signature(mb: TrainBatch) -> Signature:
    """The modalities a micro-batch's forward encodes (which encoder blocks it runs)."""
    from gymbridge.tensors.processor import MEDIA_KEY_MODALITY

    return tuple(sorted({MEDIA_KEY_MODALITY.get(k, k) for k, v in mb.media.items() if v.num_refs}))


def _repeat_source(own: list[tuple[Signature, bool]], sig: Signature) -> tuple[int, Signature] | None:
    """A micro-batch to repeat as a pass of ``sig``: one of that signature, else the first whose
    signature holds ``sig``, with the modalities to strip from it; ``None`` when there is none."""
    same = [i for i, (s, _) in enumerate(own) if s == sig]
    if same:
        return same[0], ()
    wider = [i for i, (s, _) in enumerate(own) if set(sig) <= set(s)]
    if wider:
        return wider[0], tuple(m for m in own[wider[0]][0] if m not in sig)
    return None


def lockstep_plan(
    signatures: list[list[tuple[Signature, bool]]], rank: int
) -> list[tuple[int, bool, Signature]]:
    """``rank``'s FSDP passes, given every rank's micro-batches as ``(signature, holds a loss token)``.

    Each pass is ``(index of one of its micro-batches, counted, modalities to strip from it)``.
    Passes go signature by signature (sorted), every rank running the most passes any rank has of
    it: its own micro-batches holding a loss token (counted), then repeats (not counted) of one of
    its micro-batches of that signature, else of one whose signature holds it, with the other
    modalities' media stripped (any micro-batch stripped of all media is a text-only pass). Every
    rank computes the same plan shape; a rank with no micro-batch holding a signature that a peer
    runs cannot match it: :class:`TrainingError` (the same on every rank). The driver prevents
    that by giving every shard a masked row of every modality (:func:`lockstep_shards`).
    """
    target: dict[Signature, int] = {}
    for sigs in signatures:
        for sig in {s for s, _ in sigs}:
            target[sig] = max(target.get(sig, 0), sum(1 for s, loss in sigs if s == sig and loss))
    for r, sigs in enumerate(signatures):
        missing = [sig for sig, n in target.items() if n and _repeat_source(sigs, sig) is None]
        if missing:
            raise TrainingError(
                f"fsdp: rank {r}'s shard has no micro-batch with media {list(missing[0]) or 'none'} "
                "while a peer's has, and FSDP ranks must run the same encoder blocks; use "
                "dp.strategy=replicate for such batches"
            )
    own = signatures[rank]
    passes: list[tuple[int, bool, Signature]] = []
    for sig in sorted(target):
        mine = [i for i, (s, loss) in enumerate(own) if s == sig and loss]
        passes += [(i, True, ()) for i in mine]
        short = target[sig] - len(mine)
        if short:
            source = _repeat_source(own, sig)
            assert source is not None  # checked above
            passes += [(source[0], False, source[1])] * short
    return passes


def _set_apart_copies(micro_batches: list[TrainBatch]) -> list[TrainBatch]:
    """``micro_batches`` with the driver's masked copies (:func:`lockstep_shards`) moved out of them,
    one micro-batch each at the end: they run only as uncounted repeats, never inside a counted pass
    (whose metrics, encoder references included, would count them)."""
    out: list[TrainBatch] = []
    copies: list[TrainBatch] = []
    for mb in micro_batches:
        flags = [bool(meta.get(LOCKSTEP_COPY)) for meta in mb.metadata]
        if not any(flags):
            out.append(mb)
            continue
        keep = [i for i, copy in enumerate(flags) if not copy]
        if keep:
            out.append(mb.select(keep).trim())
        copies += [mb.select([i]).trim() for i, copy in enumerate(flags) if copy]
    return out + copies


def _strip_media(mb: TrainBatch, model: Any, modalities: Signature) -> TrainBatch:
    """``mb`` without its media of ``modalities``, their placeholder tokens replaced by a text token
    (a lockstep pass)."""
    from gymbridge.families import family_of
    from gymbridge.tensors.processor import MEDIA_KEY_MODALITY

    ids = mb.input_ids.clone()
    ph = family_of(model).placeholder_ids(model.config)
    every = torch.tensor(sorted(set(ph.values())), dtype=ids.dtype)
    gone = torch.tensor(sorted({v for m, v in ph.items() if m in modalities}), dtype=ids.dtype)
    text = ids[~torch.isin(ids, every)]
    ids[torch.isin(ids, gone)] = int(text[0]) if text.numel() else 0
    media = {k: v for k, v in mb.media.items() if MEDIA_KEY_MODALITY.get(k, k) not in modalities}
    return replace(mb, input_ids=ids, media=media)


def _fqn_optimizer_state(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A ``torch.optim`` state dict keyed by parameter index -> keyed by parameter name (``names``)."""
    return {
        "state": {names[int(i)]: v for i, v in osd["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in osd["param_groups"]],
    }


def _indexed_optimizer_state(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`_fqn_optimizer_state`."""
    index = {n: i for i, n in enumerate(names)}
    return {
        "state": {index[k]: v for k, v in osd["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]],
    }


def _build(model_factory: Callable[..., Any], *, meta: bool) -> Any:
    """The factory's model on the meta device where it takes ``device`` (``from_config``), else on the CPU."""
    import inspect

    if meta and "device" in inspect.signature(model_factory).parameters:
        return model_factory(device="meta")
    if meta:
        logger.info("FSDP worker: the model factory takes no device; building it on the CPU first")
    return model_factory()


class FSDPWorker(_GroupRank):
    """The body of one FSDP Ray actor: its shards of the policy (and reference), their AdamW, one rank.

    :meth:`setup` (after :meth:`join`) builds and shards the model; :meth:`load` fills the shards.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        model_factory: Callable[..., Any],
        config: GRPOConfig,
        dtype: torch.dtype,
        cpu_offload: bool = False,
        lora: dict[str, Any] | None = None,
    ) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cuda" if torch.cuda.is_available() and not cpu_offload else "cpu")
        self.model_factory = model_factory
        self.config = config
        self.dtype = dtype
        self.cpu_offload = cpu_offload
        self.lora = lora
        self.trainer: GRPOTrainer | None = None
        self._synced = False
        self._grad_bytes = 0

    def setup(self) -> None:
        """Build the policy (and the KL reference) on the meta device and shard it over the group.

        With LoRA the adapters are injected on the meta model (peft builds them on the base layer's
        device), so they are sharded in their layer's unit beside its frozen base weights, and there is
        no reference model: the KL reference is the policy with its adapters off."""
        from gymbridge.trainer.memory import prepare_policy
        from gymbridge.trainer.sharding import claim_root, shard_model

        # fp32 master weights; bf16 compute when the trainer trains in bf16 (FSDP's mixed precision)
        dtype = self.config.torch_dtype
        model = _build(self.model_factory, meta=True).float()
        _inject_lora(model, self.lora)
        # frozen encoders, activation checkpointing; no autocast: the mixed precision policy casts
        prepare_policy(model, self.config, masters=False)
        model = shard_model(
            model, mp_dtype=None if dtype == torch.float32 else dtype, cpu_offload=self.cpu_offload
        )
        model.to_empty(device=self.device)
        claim_root(model)
        reference = None
        if self.config.kl_coef > 0 and self.lora is None:  # in the trainer's dtype, as freeze_reference
            ref = _build(self.model_factory, meta=True).to(self.config.torch_dtype)
            ref.requires_grad_(False)
            reference = shard_model(ref, mp_dtype=None, cpu_offload=self.cpu_offload)
            reference.to_empty(device=self.device)
            claim_root(reference)
            reference.eval()
        self.trainer = GRPOTrainer(model, self.config, reference=reference)

    def _trainer(self) -> GRPOTrainer:
        if self.trainer is None:
            raise TrainingError(f"FSDP worker {self.rank}: used before setup()")
        return self.trainer

    # ------------------------------------------------------------------ state

    def load(self, state: dict[str, Any]) -> None:
        """Fill the shards: ``state["model"]`` is the full state dict on rank 0 (empty elsewhere), broadcast
        from there; ``buffers``: the buffers no state dict carries (rotary frequencies), on every rank;
        ``optimizer``: the full optimizer state keyed by parameter name, or ``None`` for a fresh one."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        trainer = self._trainer()
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        for model, key in ((trainer.model, "model"), (trainer.reference, "reference")):
            if model is None:
                continue
            set_model_state_dict(model, state[key], options=options)
            with torch.no_grad():
                for name, value in state["buffers"].items():
                    model.get_buffer(name).copy_(value)
        trainer.optimizer.zero_grad(set_to_none=True)
        if state["optimizer"] is None:  # a fresh driver optimizer: a fresh one here too
            self.trainer = trainer = GRPOTrainer(trainer.model, self.config, reference=trainer.reference)
        else:
            set_optimizer_state_dict(
                trainer.model,
                trainer.optimizer,
                state["optimizer"],
                options=StateDictOptions(full_state_dict=True),
            )
        trainer.steps = int(state["steps"])

    def trainable_names(self) -> list[str]:
        """The names of the parameters this rank's optimizer updates, in its order."""
        return [n for n, p in self._trainer().model.named_parameters() if p.requires_grad]

    def optimizer_state(self) -> dict[str, Any] | None:
        """The full optimizer state (keyed by parameter name) on rank 0, else ``None``; all ranks call it.

        The seam for a sharded checkpoint: ``get_optimizer_state_dict`` without ``full_state_dict``.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        trainer = self._trainer()
        osd = get_optimizer_state_dict(
            trainer.model,
            trainer.optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True),
        )
        return dict(osd) if self.rank == 0 else None

    def save_checkpoint(self, folder: str, meta: dict[str, Any]) -> int:
        """Write this rank's slices of the policy, its AdamW state and the reference (``reference.<fqn>``)
        to ``folder`` (:func:`~gymbridge.trainer.sharded_checkpoint.save_sharded`; all ranks call
        it, rank 0 adds ``meta`` to the index); returns the bytes this rank wrote."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from gymbridge.trainer.sharded_checkpoint import flatten_model_and_optimizer, save_sharded

        trainer = self._trainer()
        tensors, index_meta = flatten_model_and_optimizer(trainer.model, trainer.optimizer)
        if trainer.reference is not None:
            ref: Any = get_model_state_dict(trainer.reference)  # declared values: a union, all tensors here
            tensors.update({f"reference.{k}": v for k, v in ref.items()})
        return save_sharded(
            folder, tensors, {**index_meta, **meta}, rank=self.rank, world_size=self.world_size
        )

    def load_checkpoint(self, folder: str, steps: int) -> None:
        """Fill this rank's shards of the policy, its AdamW state and the reference from a sharded
        checkpoint saved on any number of ranks (each rank reads only its slices); all ranks call it."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        from gymbridge.trainer.sharded_checkpoint import load_sharded, restore_model_and_optimizer

        trainer = self._trainer()
        trainer.optimizer.zero_grad(set_to_none=True)
        restore_model_and_optimizer(
            trainer.model,
            trainer.optimizer,
            folder,
            rank=self.rank,
            world_size=self.world_size,
            other_prefixes=("reference.",),
        )
        if trainer.reference is not None:
            ref: Any = get_model_state_dict(trainer.reference)
            targets = {f"reference.{k}": v for k, v in ref.items()}
            load_sharded(folder, targets, rank=self.rank, world_size=self.world_size)
            set_model_state_dict(trainer.reference, ref)
        trainer.steps = steps

    def _full(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``p`` gathered whole (a collective: every rank calls it), on the CPU in ``dtype``."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            return full.to(device="cpu", dtype=dtype)

    def gather(self, names: list[str], dtype: torch.dtype) -> GatheredBucket | None:
        """The full parameters ``names`` in ``dtype``, on rank 0 only (every rank takes part).

        One ``gather`` to rank 0 of every rank's flat buffer of its rows (``pack_shards``), cast
        to ``dtype`` before it moves; parameters that are not dim-0 shards are gathered whole.
        """
        import torch.distributed as dist

        from gymbridge.trainer.sharding import GatheredBucket, pack_shards

        params = dict(self._trainer().model.named_parameters())
        # the collective's device: NCCL moves CUDA tensors only (the shards may be offloaded)
        device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
        flat, slots, others = pack_shards(params, names, dtype, self.world_size, device)
        whole = {name: self._full(params[name], dtype) for name in others}
        if self.world_size == 1:
            parts = [flat]
        else:
            parts = [torch.empty_like(flat) for _ in range(self.world_size)] if self.rank == 0 else []
            dist.gather(flat, parts if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return None
        buffers = tuple(part.cpu().view(torch.uint8).numpy() for part in parts)
        return GatheredBucket(str(dtype).removeprefix("torch."), slots, buffers, whole)

    def digest(self) -> str:
        """sha256 of the full parameters in the driver's dtype, as :func:`param_digest` (all ranks gather)."""
        h = hashlib.sha256()
        for name, p in self._trainer().model.named_parameters():
            h.update(name.encode())
            h.update(self._full(p, self.dtype).contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------------ a step

    def _exchange(self, failed: bool, signatures: list[tuple[Signature, bool]]) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (failed, signatures))
        self._synced = True
        return gathered

    def lockstep(self, micro_batches: list[TrainBatch]) -> list[tuple[TrainBatch, bool]]:
        """The passes this rank runs so that every rank runs the same FSDP units in the same order.

        Checks every micro-batch's forward inputs first (no collective yet), then exchanges a
        failure flag and each micro-batch's media signature with the peers, and runs
        :func:`lockstep_plan`. Raises this rank's error, :class:`_PeerFailedError` when a peer
        failed, or the plan's :class:`TrainingError` (the same on every rank).
        """
        from gymbridge.trainer.forward import forward_kwargs

        trainer = self._trainer()
        error: Exception | None = None
        own: list[tuple[Signature, bool]] = []
        try:
            micro_batches = _set_apart_copies(micro_batches)
            for mb in micro_batches:  # no encoder runs here: the placeholders and media keys only
                forward_kwargs(trainer.model, mb, encoder_dedup=False)
            own = [(_media_signature(mb), float(mb.loss_mask.sum()) > 0) for mb in micro_batches]
        except Exception as exc:  # told to the peers first, raised below
            error = exc
        gathered = self._exchange(error is not None, own)
        if error is not None:
            raise error
        if any(failed for failed, _ in gathered):
            raise _PeerFailedError
        plan = lockstep_plan([sigs for _, sigs in gathered], self.rank)
        return [
            (_strip_media(micro_batches[i], trainer.model, strip) if strip else micro_batches[i], counted)
            for i, counted, strip in plan
        ]

    def compute(
        self, shard: TrainBatch, total_loss_tokens: int, total_loss_rows: int | None = None
    ) -> GradientResult | None:
        """This shard's gradients, reduce-scattered over the group inside the backward; metrics only.

        ``None``: a peer's shard failed (that worker raises); no gradient is kept.
        """
        trainer = self._trainer()
        trainer.optimizer.zero_grad(set_to_none=True)
        self._synced = False
        try:
            result = trainer.compute_gradients(
                shard,
                total_loss_tokens=total_loss_tokens,
                total_loss_rows=total_loss_rows,
                accumulate="backward",
                schedule=self.lockstep,
            )
        except _PeerFailedError:
            trainer.optimizer.zero_grad(set_to_none=True)
            return None
        except Exception:
            if not self._synced:  # failed before the exchange (planning the micro-batches): tell the peers
                self._exchange(True, [])
            trainer.optimizer.zero_grad(set_to_none=True)
            raise
        from gymbridge.trainer.sharding import resident_bytes

        self._grad_bytes = resident_bytes(trainer.model).grads
        return result

    def discard(self) -> None:
        """Drop the reduced gradients (the driver's drift guard refused the step)."""
        self._trainer().optimizer.zero_grad(set_to_none=True)

    def apply(self, send_weights: bool) -> tuple[float, None, dict[str, int]]:
        """Clip (global norm over every rank's shards) and step; the weights go by :meth:`gather`."""
        from gymbridge.trainer.sharding import resident_bytes

        del send_weights  # always streamed from the shards
        trainer = self._trainer()
        norm = trainer.apply_gradients(None)
        held = resident_bytes(trainer.model, trainer.optimizer)
        return norm, None, {**held.as_dict(), "grads": self._grad_bytes}


def fsdp_load_states(trainer: GRPOTrainer) -> tuple[dict[str, Any], dict[str, Any]]:
    """What :meth:`FSDPWorker.load` takes from ``trainer`` (the driver's): ``(rank 0's, every other rank's)``.

    Rank 0's holds the full fp32 weights of the policy and of the reference (empty when the trainer
    keeps none: ``kl_coef == 0``, or LoRA, whose reference is the policy with its adapters off),
    which it broadcasts; both hold the buffers no state dict carries, the optimizer state keyed by
    parameter name (``None`` when blank) and the step count.
    """

    def full(model: Any) -> dict[str, torch.Tensor]:
        return {
            k: v.detach().cpu().float() if v.is_floating_point() else v.detach().cpu()
            for k, v in model.state_dict().items()
        }

    model = trainer.model
    keys = set(model.state_dict())
    opt = trainer.optimizer.state_dict()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    light = {
        "model": {},
        "reference": {},
        "buffers": {n: b.detach().cpu() for n, b in model.named_buffers() if n not in keys},
        "optimizer": _fqn_optimizer_state(_to_cpu(opt), names) if opt["state"] else None,
        "steps": trainer.steps,
    }
    reference = {} if trainer.reference is None else full(trainer.reference)
    return {**light, "model": full(model), "reference": reference}, light


class RayDPTrainer:
    """GRPO steps over ``num_workers`` Ray actors in one torch.distributed group; see the module docstring.

    ``trainer`` is the driver's: its policy is the one published to the generator (rank 0's
    weights after every step) and its weights, optimizer state and step count seed the workers.
    ``num_gpus``: GPUs per actor (``None``: 1 when the cluster has one per worker, else 0).
    ``strategy``: ``replicate`` (:class:`DPWorker`) or ``fsdp`` (:class:`FSDPWorker`, with
    ``cpu_offload``; the weights come back in buckets of at most ``bucket_bytes``).
    """

    def __init__(
        self,
        trainer: GRPOTrainer,
        model_factory: Callable[[], Any],
        num_workers: int,
        *,
        meter: PayloadMeter | None = None,
        worker_num_cpus: float = 1.0,
        num_gpus: float | None = None,
        timeout_s: float = 300.0,
        strategy: DPStrategy = "replicate",
        cpu_offload: bool = False,
        bucket_bytes: int = PUBLISH_BUCKET_BYTES,
    ) -> None:
        if strategy not in ("replicate", "fsdp"):
            raise ValueError(f"strategy must be 'replicate' or 'fsdp', got {strategy!r}")
        if cpu_offload and strategy != "fsdp":
            raise ValueError("cpu_offload needs strategy='fsdp'")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        ray = require_ray()
        if not ray.is_initialized():
            init_ray()
        self.ray = ray
        self.trainer = trainer
        self.num_workers = num_workers
        self.meter = meter
        if num_gpus is None:
            num_gpus = 1.0 if float(ray.cluster_resources().get("GPU", 0.0)) >= num_workers else 0.0
        self.num_gpus = num_gpus
        self.dtype = next(trainer.model.parameters()).dtype
        self.strategy: DPStrategy = strategy
        self.cpu_offload = cpu_offload
        self.bucket_bytes = bucket_bytes
        self.lora = lora_settings(trainer.model)
        """The driver's adapter settings (:func:`~gymbridge.generation.lora.lora_settings`), which every
        worker injects into its model before loading the driver's weights; ``None`` without LoRA."""
        if strategy == "fsdp":
            actor = ray.remote(FSDPWorker).options(num_cpus=worker_num_cpus, num_gpus=num_gpus)
            self.workers = [
                actor.remote(
                    rank, num_workers, model_factory, trainer.config, self.dtype, cpu_offload, self.lora
                )
                for rank in range(num_workers)
            ]
        else:
            actor = ray.remote(DPWorker).options(num_cpus=worker_num_cpus, num_gpus=num_gpus)
            self.workers = [
                actor.remote(rank, num_workers, model_factory, trainer.config, self.dtype, self.lora)
                for rank in range(num_workers)
            ]
        nodes = ray.get([w.node_address.remote() for w in self.workers])
        host = "127.0.0.1" if len(set(nodes)) == 1 else str(nodes[0])
        port = ray.get(self.workers[0].free_port.remote(host))
        backend = "nccl" if num_gpus > 0 and torch.distributed.is_nccl_available() else "gloo"
        joined = ray.get([w.join.remote(host, port, backend, timeout_s) for w in self.workers])
        self.backend: str = joined[0]
        if strategy == "fsdp":
            ray.get([w.setup.remote() for w in self.workers])
        trainable = ray.get(self.workers[0].trainable_names.remote())
        expected = self._trainable_names()
        if trainable != expected:  # the optimizer states would not line up
            raise TrainingError(
                f"the DP workers train {len(trainable)} parameters, the driver {len(expected)}: the "
                "model_factory must build the driver's policy (its LoRA adapters are added here)"
            )
        self.last_shard_tokens: list[int] = []
        """Sequence tokens of each worker's shard in the latest step."""
        self.last_media_dtypes: dict[str, str] = {}
        """The dtype of each media key as the latest step's shards crossed to the workers."""
        self.last_weights_s = 0.0
        """Seconds of the latest step from "apply" until the driver held rank 0's new weights."""
        self.last_rank_state_bytes: list[dict[str, int]] = []
        """Each rank's resident training state after the latest update: ``params`` (its shards),
        ``grads`` (before the update), ``optimizer`` (bytes of local tensors)."""
        self.sync_workers()
        logger.info("started %d Ray DP worker(s), %s group at %s:%d", num_workers, self.backend, host, port)

    def _trainable_names(self) -> list[str]:
        """The driver's trainable parameters' names, in the optimizer's order."""
        return [n for n, p in self.trainer.model.named_parameters() if p.requires_grad]

    def sync_workers(self) -> None:
        """Give every worker the driver's weights, optimizer state and step count."""
        if self.strategy == "fsdp":
            if self.trainer.kl_reference == "sharded":  # not LoRA's: that one is the base, in every rank
                raise TrainingError(
                    "sync_workers: the driver no longer holds the KL reference (the fsdp workers do, "
                    "sharded); seed the workers from a checkpoint instead (load_sharded_checkpoint)"
                )
            self._sync_fsdp_workers()
            return
        state = {
            "model": {k: v.detach().cpu() for k, v in self.trainer.model.state_dict().items()},
            "optimizer": _to_cpu(self.trainer.optimizer.state_dict()),
            "steps": self.trainer.steps,
            "reference": None
            if self.trainer.reference is None
            else {k: v.detach().cpu() for k, v in self.trainer.reference.state_dict().items()},
        }
        ref = self.ray.put(state)
        self.ray.get([w.load.remote(ref) for w in self.workers])

    def _sync_fsdp_workers(self) -> None:
        """Rank 0 gets the full fp32 weights and broadcasts each rank its shard; every rank the rest."""
        lead, light = fsdp_load_states(self.trainer)
        refs = [self.ray.put(lead), self.ray.put(light)]
        self.ray.get(
            [w.load.remote(refs[0] if rank == 0 else refs[1]) for rank, w in enumerate(self.workers)]
        )

    def pull_optimizer_state(self) -> None:
        """Load rank 0's optimizer state into the driver's (every worker's is the same): for checkpoints.

        The driver's weights already are rank 0's (loaded after every step). With ``fsdp`` every rank
        gathers the full state (``get_optimizer_state_dict``), rank 0 returns it keyed by name.
        """
        if self.strategy == "fsdp":
            got = self.ray.get([w.optimizer_state.remote() for w in self.workers])[0]
            self.trainer.optimizer.load_state_dict(_indexed_optimizer_state(got, self._trainable_names()))
            return
        self.trainer.optimizer.load_state_dict(self.ray.get(self.workers[0].optimizer_state.remote()))

    def save_sharded_checkpoint(self, folder: Path, meta: dict[str, Any]) -> None:
        """``fsdp``: every worker writes its slices (policy, AdamW state, reference) to ``folder``; the
        driver receives nothing but the byte counts (the run's own state is written apart:
        :func:`gymbridge.trainer.checkpoint.save_sharded_checkpoint`)."""
        if self.strategy != "fsdp":
            raise ValueError("sharded checkpoints are written by fsdp workers; replicate saves one file")
        written = self.ray.get([w.save_checkpoint.remote(str(folder), meta) for w in self.workers])
        logger.debug("sharded checkpoint %s: %s bytes per rank", folder, written)

    def load_sharded_checkpoint(self, folder: Path) -> None:
        """``fsdp``: every worker fills its shards (policy, AdamW state, reference) from ``folder``, saved
        on any number of workers; the step count is the driver's. The driver's own policy is loaded
        apart (:func:`gymbridge.trainer.checkpoint.load_checkpoint`)."""
        if self.strategy != "fsdp":
            raise ValueError("only fsdp workers load a sharded checkpoint; replicate ones take the driver's")
        self.ray.get([w.load_checkpoint.remote(str(folder), self.trainer.steps) for w in self.workers])

    def publish_buckets(self) -> list[list[str]]:
        """The parameter names of each publication bucket: consecutive, at most ``bucket_bytes`` of the
        driver's dtype each (one larger parameter alone). With LoRA only the published names
        (:func:`~gymbridge.generation.lora.published_names`: the adapters and any fully trained encoder)."""
        keep = published_names(self.trainer.model)
        buckets: list[list[str]] = [[]]
        size = 0
        for name, p in self.trainer.model.named_parameters():
            if keep is not None and name not in keep:
                continue
            nbytes = p.numel() * p.element_size()
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(name)
            size += nbytes
        return buckets

    def _publish_from_shards(self) -> None:
        """Stream the sharded weights into the driver's policy, one bucket of full tensors at a time."""
        params = dict(self.trainer.model.named_parameters())
        buckets = self.publish_buckets()

        def gather(names: list[str]) -> list[Any]:
            return [w.gather.remote(names, self.dtype) for w in self.workers]

        # one bucket ahead: the ranks gather the next while the driver copies this one (two at most)
        pending = gather(buckets[0])
        with torch.no_grad():
            for i in range(len(buckets)):
                ahead = gather(buckets[i + 1]) if i + 1 < len(buckets) else []
                got = self.ray.get(pending)[0]
                got.copy_into(params)
                del got
                pending = ahead

    def step(self, batch: TrainBatch) -> StepMetrics:
        started = time.perf_counter()
        batch, truncated = self.trainer.prepare(batch)  # the whole batch's loss mask, before the split
        skipped = skip_reason(batch, self.trainer.config)
        if skipped is not None:  # no learning signal: no worker steps, weights stay identical
            log_skipped_step(batch, skipped)
            return summarize(
                batch, [], 0.0, time.perf_counter() - started, truncated_masked=truncated, skipped=skipped
            )
        shards = policy_shards(batch, self.num_workers, self.trainer.config.torch_dtype)
        self.last_shard_tokens = [s.num_tokens for s in shards]  # the rows each trains, not the masked ones
        if self.strategy == "fsdp":  # every rank runs the same passes: masked rows of what a shard lacks
            shards = lockstep_shards(shards)
        self.last_media_dtypes = {
            k: str(v.dtype).removeprefix("torch.")
            for s in shards
            for k, v in s.media.items()
            if v.num_segments
        }
        if self.meter is not None:
            for i, shard in enumerate(shards):
                self.meter.record("policy_shard", shard, shard=i)
        total = int(batch.loss_mask.sum())
        rows = loss_rows(batch.loss_mask)
        got = self.ray.get(
            [w.compute.remote(s, total, rows) for w, s in zip(self.workers, shards, strict=True)]
        )
        parts: list[GradientResult] = [p for p in got if p is not None]
        if len(parts) != len(got):  # a failing worker raises; reaching here means one returned early
            raise TrainingError("a DP worker dropped its gradients without an error")
        lead = next((p for p in parts if p.loss_tokens), None)
        if lead is not None:
            try:
                self.trainer.check_drift(lead)  # before any worker moves
            except PolicyDriftError:
                self.ray.get([w.discard.remote() for w in self.workers])
                raise
        applied = time.perf_counter()
        lr = self.trainer.config.lr_at(self.trainer.steps + 1)  # what every worker's apply uses
        outs = self.ray.get([w.apply.remote(rank == 0) for rank, w in enumerate(self.workers)])
        norm, weights, _ = outs[0]
        self.last_rank_state_bytes = [held for _, _, held in outs]
        if self.strategy == "fsdp":
            self._publish_from_shards()
        else:
            assert weights is not None
            _load_published(self.trainer.model, weights)
        self.last_weights_s = time.perf_counter() - applied
        self.trainer.steps += 1
        return summarize(
            batch,
            parts,
            norm,
            time.perf_counter() - started,
            truncated_masked=truncated,
            lr=lr,
            optimizer_s=self.last_weights_s,  # the workers' updates and rank 0's weights back here
        )

    def param_digests(self) -> list[str]:
        """The driver's parameter digest followed by every worker's (all equal when in sync)."""
        return [param_digest(self.trainer.model), *self.ray.get([w.digest.remote() for w in self.workers])]

    def shutdown(self) -> None:
        if self.workers:
            try:
                self.ray.get([w.close.remote() for w in self.workers], timeout=30)
            except Exception:  # a dead actor: killed below anyway
                logger.debug("closing the DP group failed", exc_info=True)
        for w in self.workers:
            self.ray.kill(w)
        self.workers = []
