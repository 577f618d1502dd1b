"""Publish to a vLLM model server through vLLM's own weight-transfer protocol.

vLLM ships the trainer-to-engine protocol RL frameworks use (``vllm.distributed.weight_transfer``):
an init handshake, then per version ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``, over one of two data planes:

* ``nccl`` (the trainer on other GPUs): the trainer is rank 0 of an NCCL group with every vLLM
  worker and broadcasts the weights *packed*: in metadata order, each tensor's bytes
  (``contiguous().view(uint8)``) appended to a uint8 chunk, a chunk closed after the tensor that
  takes it past ``packed_buffer_size_bytes`` (so a chunk exceeds the bound by less than its last
  tensor) or at the end; both sides cut the same chunks from ``names`` / ``dtype_names`` /
  ``shapes`` alone (:func:`packed_chunk_bounds`). vLLM's receiver views the bytes in place, so
  tensors travel widest element first (:func:`transfer_order`: every offset aligned);
* ``ipc`` (the trainer on the workers' GPU, where NCCL refuses a second rank): one CUDA IPC handle
  per tensor of the trainer's own storage; the workers copy from it. Nothing is packed or sent
  over a network.

:class:`VLLMTransferPublisher` speaks it to a gymbridge model server (``--backend vllm``) over the
server's ``/weights/*`` routes with ``transport: "vllm"``; the server's
:class:`~gymbridge.generation.vllm.VLLMWeightSink` drives the engine's own methods inside a weight
swap. The backend follows the placement: ``probe`` lists the workers' GPU UUIDs, the trainer's GPU
among them means ``ipc``, none of them ``nccl``.

Invariants:

* vLLM is imported only where it is importable (:func:`vllm_importable`): then the NCCL side is
  vLLM's own trainer engine (``WeightTransferTrainerFactory.trainer_init`` with
  ``NCCLTrainerInitInfo``, rendezvous over a TCPStore this process hosts); without it, gymbridge
  writes the same packed format (:func:`packed_chunks`) over a communicator of torch's own
  (``torch.cuda.nccl``) that joins through vLLM's ``nccl_unique_id_b64`` rendezvous. The IPC side
  is gymbridge's either way (vLLM's trainer engine gathers handles over the default process group,
  which a publishing rank does not own);
* full weights only: a LoRA model keeps gymbridge's adapter path (:func:`unsupported_reason`);
* ``publish`` returns once the server answers the update: the version is live on every worker.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import importlib.util
import logging
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, Protocol

import torch

from gymbridge.errors import WeightSyncError
from gymbridge.generation.weights import TensorSpec, published_weights

logger = logging.getLogger(__name__)

__all__ = [
    "PACKED_BUFFER_BYTES",
    "PACKED_NUM_BUFFERS",
    "TransferBackend",
    "VLLMTransferPublisher",
    "choose_backend",
    "nccl_unique_id_init_info",
    "pack_chunk",
    "packed_chunk_bounds",
    "packed_chunks",
    "transfer_order",
    "unsupported_reason",
    "update_info",
    "vllm_importable",
    "weight_source",
]

TransferBackend = Literal["nccl", "ipc"]
PACKED_BUFFER_BYTES = 1024**3
"""Bytes after which a packed chunk closes (vLLM's ``DEFAULT_PACKED_BUFFER_SIZE_BYTES``)."""
PACKED_NUM_BUFFERS = 2
"""Chunks in flight at once on each side (vLLM's ``DEFAULT_PACKED_NUM_BUFFERS``)."""
_TRANSPORT = "vllm"


def vllm_importable() -> bool:
    """Whether this process can import vLLM's weight-transfer module (without importing it)."""
    try:
        return importlib.util.find_spec("vllm.distributed.weight_transfer") is not None
    except (ImportError, ValueError):  # no vllm (or a half-installed one): find_spec of a submodule raises
        return False


# ---------------------------------------------------------------------- the wire format


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def update_info(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """vLLM's per-version update info for ``named``: ``names``, ``dtype_names`` (``"bfloat16"``),
    ``shapes`` (lists), in the order the tensors travel."""
    return {
        "names": [n for n, _ in named],
        "dtype_names": [_dtype_name(t.dtype) for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
    }


def transfer_order(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``named`` in the order it is packed: by element size, largest first, otherwise as given.

    vLLM's receiver views each tensor's bytes in place (``view(dtype)`` of a slice of the uint8
    chunk), which needs the tensor's offset in its chunk to be a multiple of its element size; the
    packed format has no padding. With the widest elements first every offset is (a chunk starts at
    0 and holds an ordered run of this order), whatever the dtypes; the state-dict order is kept
    within a width, so layers stay together for vLLM's layerwise reload.
    """
    return sorted(named, key=lambda item: -item[1].element_size())


def packed_chunk_bounds(sizes_bytes: Sequence[int], buffer_size_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` tensor index ranges of the packed chunks for tensors of ``sizes_bytes``.

    A chunk takes tensors in order and closes right after the one that brings its bytes above
    ``buffer_size_bytes``; the last chunk takes what is left. No chunk is empty.
    """
    if buffer_size_bytes < 1:
        raise ValueError("buffer_size_bytes must be >= 1")
    bounds: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, size in enumerate(sizes_bytes):
        used += size
        if used > buffer_size_bytes:
            bounds.append((start, i + 1))
            start, used = i + 1, 0
    if start < len(sizes_bytes):
        bounds.append((start, len(sizes_bytes)))
    return bounds


def pack_chunk(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, each in C order, one after another: a uint8 tensor ``[sum of nbytes]`` on
    the tensors' device."""
    flat = [t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]
    if not flat:
        raise ValueError("a packed chunk holds at least one tensor")
    return torch.cat(flat) if len(flat) > 1 else flat[0]


def packed_chunks(
    named: Sequence[tuple[str, torch.Tensor]], buffer_size_bytes: int = PACKED_BUFFER_BYTES
) -> Iterator[tuple[list[str], torch.Tensor]]:
    """``(names, chunk)`` for each packed chunk of ``named``, one at a time (at most one chunk held)."""
    sizes = [t.numel() * t.element_size() for _, t in named]
    for start, stop in packed_chunk_bounds(sizes, buffer_size_bytes):
        part = named[start:stop]
        yield [n for n, _ in part], pack_chunk(t for _, t in part)


def nccl_unique_id_init_info(
    unique_id: bytes,
    world_size: int,
    *,
    buffer_size_bytes: int = PACKED_BUFFER_BYTES,
    num_buffers: int = PACKED_NUM_BUFFERS,
) -> dict[str, Any]:
    """vLLM's NCCL worker init info for a trainer that minted the group's ``ncclUniqueId`` itself
    (``nccl_unique_id_b64``: standard base64 of its 128 bytes); the workers follow the trainer
    (``rank_offset`` 1) and read the packed format with the trainer's buffer geometry."""
    return {
        "rank_offset": 1,
        "world_size": world_size,
        "nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"),
        "packed": True,
        "packed_buffer_size_bytes": buffer_size_bytes,
        "packed_num_buffers": num_buffers,
    }


# ---------------------------------------------------------------------- placement


def choose_backend(trainer_gpu_uuid: str | None, worker_gpu_uuids: Sequence[str]) -> TransferBackend:
    """``ipc`` when every vLLM worker is on the trainer's GPU, ``nccl`` when none is; anything else
    (workers off CUDA, some on the trainer's GPU and some not, a trainer off CUDA) raises
    :class:`WeightSyncError` naming the transport that still works."""
    if not trainer_gpu_uuid:
        raise WeightSyncError("vLLM's weight transfer needs the trainer's weights on a CUDA GPU")
    if not worker_gpu_uuids or not all(worker_gpu_uuids):
        raise WeightSyncError("vLLM's weight transfer needs every vLLM worker on a CUDA GPU")
    shared = [u == trainer_gpu_uuid for u in worker_gpu_uuids]
    if all(shared):
        return "ipc"
    if not any(shared):
        return "nccl"
    raise WeightSyncError(
        f"{sum(shared)} of the {len(shared)} vLLM workers share the trainer's GPU: CUDA IPC reaches only "
        "those and NCCL refuses two ranks on one GPU; publish with generator.weight_transport broadcast"
    )


def unsupported_reason(model: Any) -> str | None:
    """Why ``model`` cannot publish through vLLM's weight transfer (``None``: it can)."""
    from gymbridge.generation.lora import published_names

    if published_names(model) is not None:
        return "a LoRA model's adapters keep gymbridge's adapter path (vLLM's transfer is for full weights)"
    devices = {t.device for _, t in published_weights(model)}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return f"vLLM's weight transfer sends from one CUDA device, not from {sorted(map(str, devices))}"
    return None


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` as the current CUDA device (vLLM's trainer engine and NCCL use the current one)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# ---------------------------------------------------------------------- control plane


class _Client:
    """vLLM's trainer-side control plane (its ``VLLMWeightSyncClient``: four methods) over the model
    server's ``/weights/*`` routes. ``start`` / ``finish`` are this side's only: the server runs the
    whole round (pause, ``start_weight_update``, ``update_weights``, ``finish_weight_update``, cache
    resets, resume) while answering ``update_weights``."""

    def __init__(
        self, post: Any, *, backend: TransferBackend, tensors: list[dict[str, Any]], timeout_s: float
    ):
        self._post = post
        self.backend = backend
        self.tensors = tensors
        self.timeout_s = timeout_s
        self.version: int | None = None
        self.answer: dict[str, Any] = {}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.answer = self._post(
            {
                "step": "init",
                "backend": self.backend,
                "init_info": init_info,
                "tensors": self.tensors,
                "timeout_s": self.timeout_s,
            }
        )

    def start_weight_update(self) -> None:
        if self.version is None:
            raise WeightSyncError("no policy version to publish")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        if not isinstance(update_info, dict):
            raise WeightSyncError("gymbridge's model server takes one update info per publication")
        self.answer = self._post(
            {
                "step": "update",
                "version": self.version,
                "update_info": _json_safe(update_info),
                "timeout_s": self.timeout_s,
            }
        )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        return None


def _json_safe(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` with raw CUDA IPC handles (tuples) as :func:`~gymbridge.generation.vllm.encode_ipc_handle`
    writes them."""
    from gymbridge.generation.vllm import encode_ipc_handle

    handles = info.get("ipc_handles")
    if handles is None:
        return info
    if isinstance(handles, dict):
        encoded: Any = {u: a if isinstance(a, dict) else encode_ipc_handle(a) for u, a in handles.items()}
    else:
        encoded = [
            {u: a if isinstance(a, dict) else encode_ipc_handle(a) for u, a in h.items()} for h in handles
        ]
    return {**info, "ipc_handles": encoded}


# ---------------------------------------------------------------------- data planes


class _Sender(Protocol):
    def connect(self) -> None: ...

    def send(self) -> None: ...

    def close(self) -> None: ...


class _NCCLComm(Protocol):
    def broadcast(self, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class _TorchNCCL:
    """Rank 0 of an NCCL group built by torch's own bindings (``torch.cuda.nccl``) from a unique id."""

    def __init__(self, comm: Any, device: torch.device) -> None:
        self.comm = comm
        self.device = device

    def broadcast(self, tensor: torch.Tensor) -> None:
        torch.cuda.nccl.broadcast([tensor], root=0, comms=[self.comm])

    def close(self) -> None:
        self.comm = None


def _new_unique_id() -> bytes:
    """A fresh ``ncclUniqueId`` (128 bytes) from torch's NCCL."""
    return bytes(torch.cuda.nccl.unique_id())  # type: ignore[no-untyped-call]  # torch ships it untyped


def _open_torch_nccl(unique_id: bytes, world_size: int, device: torch.device) -> _NCCLComm:
    """Join the group as rank 0 (blocks until every rank has), then the one-element float32
    ``all_reduce`` vLLM's communicator issues right after joining (its warm-up handshake)."""
    with torch.cuda.device(device):
        comm = torch.cuda.nccl.init_rank(world_size, unique_id, 0)  # type: ignore[no-untyped-call]  # untyped in torch
        warmup = torch.zeros(1, dtype=torch.float32, device=device)
        torch.cuda.nccl.all_reduce([warmup], comms=[comm])  # type: ignore[no-untyped-call]  # untyped in torch
        torch.cuda.current_stream(device).synchronize()
    return _TorchNCCL(comm, device)


class _OwnNCCLSender:
    """The packed NCCL broadcast written by gymbridge (no vLLM in this process)."""

    def __init__(
        self,
        client: _Client,
        model: Any,
        device: torch.device,
        world_size: int,
        buffer_bytes: int,
        num_buffers: int,
    ) -> None:
        self.client, self.model, self.device = client, model, device
        self.world_size, self.buffer_bytes, self.num_buffers = world_size, buffer_bytes, num_buffers
        self.comm: _NCCLComm | None = None

    def connect(self) -> None:
        unique_id = _new_unique_id()
        info = nccl_unique_id_init_info(
            unique_id, self.world_size, buffer_size_bytes=self.buffer_bytes, num_buffers=self.num_buffers
        )
        self.comm = _rendezvous(
            lambda: self.client.init_weight_transfer_engine(info),
            lambda: _open_torch_nccl(unique_id, self.world_size, self.device),
            timeout_s=self.client.timeout_s,
        )

    def send(self) -> None:
        comm = self.comm
        if comm is None:
            raise WeightSyncError("the NCCL group is closed")
        named = transfer_order(published_weights(self.model))
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gymbridge-vllm-update")
        try:
            answer = pool.submit(self.client.update_weights, update_info(named))  # received meanwhile
            with torch.no_grad(), _on_device(self.device):
                for _names, chunk in packed_chunks(named, self.buffer_bytes):
                    if answer.done():  # the server refused before receiving: no peer for the bytes
                        answer.result()
                    comm.broadcast(chunk)
                _synchronize(self.device)
            answer.result()
        finally:
            # never joined: after a failed broadcast the server's call waits for bytes that never come
            pool.shutdown(wait=False)
        self.client.finish_weight_update()

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None


class _VLLMNCCLSender:
    """vLLM's own ``NCCLTrainerWeightTransferEngine`` (packed), built by its trainer factory."""

    def __init__(
        self,
        client: _Client,
        model: Any,
        device: torch.device,
        world_size: int,
        host: str,
        buffer_bytes: int,
        num_buffers: int,
    ) -> None:
        self.client, self.model, self.device = client, model, device
        self.world_size, self.host = world_size, host
        self.buffer_bytes, self.num_buffers = buffer_bytes, num_buffers
        self.engine: Any = None

    def connect(self) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        init_info = NCCLTrainerInitInfo(
            master_address=self.host,
            master_port=_free_port(self.host),
            world_size=self.world_size,
            rank=0,
            packed=True,
            packed_buffer_size_bytes=self.buffer_bytes,
            packed_num_buffers=self.num_buffers,
        )
        with _on_device(self.device):
            self.engine = WeightTransferTrainerFactory.trainer_init(
                init_info, client=self.client, source=weight_source(self.model)
            )

    def send(self) -> None:
        if self.engine is None:
            raise WeightSyncError("the NCCL group is closed")
        with torch.no_grad(), _on_device(self.device):
            self.engine.send_weights()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def weight_source(model: Any) -> Any:
    """vLLM's ``WeightSource`` over ``model``'s published weights in :func:`transfer_order` (needs
    vLLM): ``metadata`` read once, ``iter_full`` yields the model's own tensors in that order."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class PublishedWeights(WeightSource):  # type: ignore[misc]  # vLLM is untyped here
        @functools.cached_property
        def metadata(self) -> list[Any]:
            return [
                ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in transfer_order(published_weights(model))
            ]

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from transfer_order(published_weights(model))

    return PublishedWeights()


class _IPCSender:
    """One CUDA IPC handle per tensor, of the trainer's own storage; the workers copy from it."""

    def __init__(self, client: _Client, model: Any, device: torch.device) -> None:
        self.client, self.model, self.device = client, model, device

    def connect(self) -> None:
        self.client.init_weight_transfer_engine({"packed": False})

    def send(self) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        from gymbridge.generation.vllm import encode_ipc_handle

        uuid = _gpu_uuid(self.device)
        named = published_weights(self.model)
        kept = [t.detach().contiguous() for _, t in named]  # alive until the workers have copied
        info = update_info(named)
        shared = [reduce_tensor(t)[1] for t in kept]  # type: ignore[no-untyped-call]  # untyped in torch
        info["ipc_handles"] = [{uuid: encode_ipc_handle(args)} for args in shared]
        _synchronize(self.device)  # every write lands before a worker reads
        self.client.start_weight_update()
        self.client.update_weights(info)
        self.client.finish_weight_update()
        del kept, shared
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]  # untyped in torch

    def close(self) -> None:
        return None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _rendezvous(init_worker: Any, open_trainer: Any, *, timeout_s: float) -> Any:
    """Run the server's init call and this side's join together (each waits for the other); a
    server that fails is reported at once, not after a join that can no longer complete."""
    outcome: dict[str, Any] = {}

    def join() -> None:
        try:
            outcome["comm"] = open_trainer()
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc

    thread = threading.Thread(target=join, name="gymbridge-vllm-transfer-join", daemon=True)
    thread.start()
    init_worker()  # returns once every worker has joined (or raises with the server's error)
    thread.join(timeout_s)
    if thread.is_alive():
        raise WeightSyncError(f"this process did not join vLLM's weight-transfer group within {timeout_s:g}s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["comm"]


# ---------------------------------------------------------------------- the publisher


class VLLMTransferPublisher:
    """Publish full weights to a vLLM model server through vLLM's weight-transfer protocol.

    ``url`` is the server's base URL; ``backend`` ``auto`` follows the placement
    (:func:`choose_backend`), ``nccl`` / ``ipc`` force one. With NCCL the trainer hosts the
    rendezvous on ``host`` (vLLM's trainer engine) or mints the group's unique id (gymbridge's own
    sender; ``use_vllm`` picks, default: vLLM where importable); ``buffer_bytes`` /
    ``num_buffers`` are the packed geometry both sides use. ``timeout_s`` bounds every call;
    ``secret`` is the run secret the weight routes require (or pass ``http``, an ``httpx.Client``
    that already sends it). The same :class:`~gymbridge.trainer.weight_sync.WeightPublisher`
    surface as the other publishers: :meth:`publish`, :meth:`close`, ``syncs``, ``last_bytes``,
    ``last_sync_s``, ``last_timings``.
    """

    transport = _TRANSPORT

    def __init__(
        self,
        url: str,
        *,
        backend: Literal["auto", "nccl", "ipc"] = "auto",
        host: str = "127.0.0.1",
        buffer_bytes: int = PACKED_BUFFER_BYTES,
        num_buffers: int = PACKED_NUM_BUFFERS,
        timeout_s: float = 120.0,
        secret: str | None = None,
        use_vllm: bool | None = None,
        http: Any = None,
    ) -> None:
        import httpx

        if backend not in ("auto", "nccl", "ipc"):
            raise ValueError(f"backend must be auto, nccl or ipc, got {backend!r}")
        if buffer_bytes < 1 or num_buffers < 1:
            raise ValueError("buffer_bytes and num_buffers must be >= 1")
        self.url = url.rstrip("/")
        self.requested_backend = backend
        self.host = host
        self.buffer_bytes = buffer_bytes
        self.num_buffers = num_buffers
        self.timeout_s = timeout_s
        self.use_vllm = vllm_importable() if use_vllm is None else use_vllm
        self._owns_http = http is None
        auth = {"Authorization": f"Bearer {secret}"} if secret else None
        self._http = (
            http if http is not None else httpx.Client(timeout=timeout_s, trust_env=False, headers=auth)
        )
        self.backend: TransferBackend | None = None
        """The data plane in use (``None`` until connected)."""
        self._model: Any = None
        self._client: _Client | None = None
        self._sender: _Sender | None = None
        self.version: int | None = None
        self.syncs = 0
        self.last_sync_s = 0.0
        self.last_bytes = 0
        self.last_timings: dict[str, float] = {}

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        path = "/weights/update" if body.get("step") == "update" else "/weights/init_group"
        try:
            # the init and update calls answer once the workers are done: a margin over timeout_s
            reply = self._http.post(
                f"{self.url}{path}", json={"transport": _TRANSPORT, **body}, timeout=self.timeout_s + 30
            )
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"POST {self.url}{path} ({body.get('step')}) failed: {exc}") from exc
        if reply.status_code != 200:
            try:
                message = reply.json().get("message", reply.text)
            except ValueError:
                message = reply.text
            raise WeightSyncError(
                f"POST {self.url}{path} ({body.get('step')}) -> {reply.status_code}: {message}"
            )
        data = reply.json()
        return data if isinstance(data, dict) else {}

    def connect(self, model: Any) -> None:
        """Pick the backend and run the init handshake (idempotent for the same ``model``)."""
        if self._sender is not None:
            if model is not self._model:
                raise WeightSyncError("this publisher is connected for another model object")
            return
        reason = unsupported_reason(model)
        if reason is not None:
            raise WeightSyncError(reason)
        named = published_weights(model)
        device = named[0][1].device
        probe = self._post({"step": "probe"})
        workers = [str(u) for u in probe.get("gpu_uuids") or ()]
        if len(workers) != probe.get("ranks"):
            raise WeightSyncError(f"the server reported {probe.get('ranks')} workers but {len(workers)} GPUs")
        backend: TransferBackend
        if self.requested_backend == "auto":
            backend = choose_backend(_gpu_uuid(device), workers)
        else:
            backend = self.requested_backend
        tensors = [TensorSpec(n, tuple(t.shape), _dtype_name(t.dtype)).to_json() for n, t in named]
        client = _Client(self._post, backend=backend, tensors=tensors, timeout_s=self.timeout_s)
        sender: _Sender
        world_size = 1 + len(workers)
        if backend == "ipc":
            sender = _IPCSender(client, model, device)
        elif self.use_vllm:
            sender = _VLLMNCCLSender(
                client, model, device, world_size, self.host, self.buffer_bytes, self.num_buffers
            )
        else:
            sender = _OwnNCCLSender(client, model, device, world_size, self.buffer_bytes, self.num_buffers)
        sender.connect()
        self._model, self._client, self._sender, self.backend = model, client, sender, backend
        logger.info(
            "vLLM weight transfer with %s ready (%s, %d workers, %s trainer side)",
            self.url,
            backend,
            len(workers),
            "vLLM's" if self.use_vllm and backend == "nccl" else "gymbridge's",
        )

    def publish(self, model: Any, version: int) -> float:
        """Send ``model``'s weights as ``version``; returns once every worker serves it."""
        started = time.perf_counter()
        if self.version is not None and version < self.version:
            raise WeightSyncError(f"policy version {version} is older than the published {self.version}")
        self.connect(model)
        assert self._client is not None and self._sender is not None
        self._client.version = version
        self._sender.send()
        answer = self._client.answer
        if answer.get("status") != "loaded" or answer.get("version") != version:
            raise WeightSyncError(f"the server did not confirm policy version {version}: {answer}")
        self.version = version
        self.syncs += 1
        self.last_bytes = sum(t.numel() * t.element_size() for _, t in published_weights(model))
        self.last_sync_s = time.perf_counter() - started
        self.last_timings = {"load_s": float(answer.get("seconds", 0.0))}
        return self.last_sync_s

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        self._client = None
        if self._owns_http:
            self._http.close()
