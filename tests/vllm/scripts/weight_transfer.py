"""Run in .venv-vllm: vLLM's own weight-transfer protocol between gymbridge's trainer side and its sink.

Three parts, each printed under its key of one JSON object:

``names``: every vLLM name gymbridge's vLLM weight-transfer code calls (``AsyncLLM``'s methods,
the request and init / update info types and their fields, the worker's methods and attributes,
the engine and trainer factories, ``WeightSource`` / ``ParamMeta``, the IPC rebuild arguments,
the packed defaults) exists with the parameters gymbridge passes: ``problems`` lists what does not.

``packing``: gymbridge's trainer-side packing (:mod:`gymbridge.trainer.vllm_transfer`) read by
vLLM's own receiver, ``packed_nccl_broadcast_consumer``, through a group that hands it gymbridge's
chunks (its size must equal the chunk's: both sides cut the same chunks): every tensor comes back
equal, for several dtypes (fp32, bf16, fp16, fp64, int64, int32, int8, uint8, bool), shapes (a
scalar, an empty tensor, a transposed one) and buffer bounds (1 byte, an exact fill, in between,
larger than everything); and the other way, vLLM's ``pack_tensors`` writes the same bytes. The
control: the same tensors in state-dict order (a 14-byte bf16 tensor before an int64 one) make
vLLM's receiver fail, which :func:`~gymbridge.trainer.vllm_transfer.transfer_order` prevents.

``round_trip``: the tiny Qwen2-VL as vLLM's model class on the CPU, behind a one-worker stand-in
for ``AsyncLLM`` whose weight-transfer methods are ``AsyncLLM``'s own and whose ``collective_rpc``
goes through vLLM's msgpack encoding to a worker made of vLLM ``Worker``'s own methods plus
gymbridge's extension (vLLM's engines from ``WeightTransferEngineFactory``, the layerwise reload).
``VLLMTransferPublisher`` publishes a second set of weights to ``VLLMWeightSink`` over an
in-process HTTP transport answering as the model server's routes do, once per trainer side: NCCL
with vLLM's own ``NCCLTrainerWeightTransferEngine``, NCCL with gymbridge's packing, IPC. Every
vLLM parameter must equal the one vLLM's ``load_weights`` gives from the same weights directly.
CPU stand-ins: the NCCL group is an in-process pipe, CUDA streams and events are no-ops, an IPC
handle names a tensor of this process (``reduce_tensor`` / ``rebuild_cuda_tensor`` swapped).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import inspect
import json
import queue
import sys
import tempfile
import threading
import types
from typing import Any

import torch
from weight_names import borrow_cpu_attention_selector, init_distributed

problems: list[str] = []
checked: list[str] = []
UNIQUE_ID = bytes(range(128))
"""The ``ncclUniqueId`` gymbridge's own NCCL sender mints here (torch's NCCL needs a GPU)."""


def check(ok: bool, what: str) -> None:
    checked.append(what)
    if not ok:
        problems.append(what)


def params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def field_names(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# ---------------------------------------------------------------------- names


def check_names() -> dict[str, Any]:
    import vllm
    from torch.multiprocessing import reductions
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import (
        base,
        factory,
        ipc_engine,
        nccl_common,
        nccl_engine,
        packed_tensor,
    )
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.worker.gpu_worker import Worker

    from gymbridge.generation import vllm as backend
    from gymbridge.trainer import vllm_transfer as trainer

    check(
        backend.weight_transfer_available(),
        "weight_transfer_available() detects vllm.distributed.weight_transfer",
    )
    check(
        "weight_transfer_config" in field_names(vllm.AsyncEngineArgs),
        "AsyncEngineArgs.weight_transfer_config",
    )
    check(params(WeightTransferConfig)[:1] == ["backend"], "WeightTransferConfig(backend=)")
    built: list[Any] = []
    original = AsyncLLM.from_engine_args
    AsyncLLM.from_engine_args = classmethod(lambda cls, args: built.append(args) or types.SimpleNamespace())
    try:
        backend.VLLMGenerator(tempfile.mkdtemp(), load_processor=False)  # a local path: HF is offline
    finally:
        AsyncLLM.from_engine_args = original
    config = built[0].weight_transfer_config if built else None
    check(
        isinstance(config, WeightTransferConfig) and config.backend == "nccl",
        "VLLMGenerator's AsyncEngineArgs carry weight_transfer_config (backend nccl)",
    )
    for name in ("nccl", "ipc"):
        check(name in factory.WeightTransferEngineFactory._registry, f"engine factory registers {name}")
    check(
        params(factory.WeightTransferEngineFactory.create_engine)
        == ["config", "vllm_config", "device", "model"],
        "WeightTransferEngineFactory.create_engine(config, vllm_config, device, model)",
    )
    check("nccl" in factory.WeightTransferTrainerFactory._registry, "trainer factory registers nccl")
    check(
        params(factory.WeightTransferTrainerFactory.trainer_init) == ["init_info", "client", "source"],
        "WeightTransferTrainerFactory.trainer_init(init_info, *, client, source)",
    )

    # AsyncLLM: the methods the sink awaits, with what it passes
    for method, expected in (
        ("init_weight_transfer_engine", ["self", "request"]),
        ("start_weight_update", ["self"]),
        ("update_weights", ["self", "request"]),
        ("finish_weight_update", ["self", "weight_version"]),
    ):
        fn = getattr(AsyncLLM, method, None)
        check(
            fn is not None and inspect.iscoroutinefunction(fn) and params(fn) == expected,
            f"await AsyncLLM.{method}({', '.join(expected[1:])})",
        )
    src = inspect.getsource(AsyncLLM.init_weight_transfer_engine) + inspect.getsource(AsyncLLM.update_weights)
    check(
        "request.init_info" in src and "request.update_info" in src,
        "AsyncLLM reads request.init_info / update_info",
    )
    check(
        field_names(base.WeightTransferInitRequest) == {"init_info"}, "WeightTransferInitRequest(init_info=)"
    )
    check(
        field_names(base.WeightTransferUpdateRequest) == {"update_info"},
        "WeightTransferUpdateRequest(update_info=)",
    )

    # the worker: vLLM's methods AsyncLLM reaches, the attributes the extension uses
    for method, expected in (
        ("init_weight_transfer_engine", ["self", "init_info"]),
        ("start_weight_update", ["self"]),
        ("update_weights", ["self", "update_info"]),
        ("finish_weight_update", ["self"]),
    ):
        check(params(getattr(Worker, method)) == expected, f"Worker.{method}({', '.join(expected[1:])})")
    worker_src = inspect.getsource(Worker)
    for attr in (
        "self.weight_transfer_engine",
        "self._weight_update_active",
        "self.vllm_config",
        "self.device =",
    ):
        check(attr in worker_src, f"Worker sets {attr}")
    for method in ("shutdown", "finish_weight_update", "reset_weight_update_target", "parse_update_info"):
        check(callable(getattr(base.WeightTransferEngine, method, None)), f"WeightTransferEngine.{method}")
    check(
        "self.config = config" in inspect.getsource(base.WeightTransferEngine.__init__),
        "WeightTransferEngine.config",
    )

    # init / update info fields gymbridge writes
    check(
        {
            "rank_offset",
            "world_size",
            "nccl_unique_id_b64",
            "packed",
            "packed_buffer_size_bytes",
            "packed_num_buffers",
            "master_address",
            "master_port",
        }
        <= field_names(nccl_common.NCCLWeightTransferInitInfo),
        "NCCLWeightTransferInitInfo fields",
    )
    check(
        field_names(nccl_engine.NCCLWeightTransferUpdateInfo) == {"names", "dtype_names", "shapes"},
        "NCCLWeightTransferUpdateInfo(names, dtype_names, shapes)",
    )
    check(
        {
            "master_address",
            "master_port",
            "world_size",
            "rank",
            "packed",
            "packed_buffer_size_bytes",
            "packed_num_buffers",
        }
        <= field_names(nccl_engine.NCCLTrainerInitInfo),
        "NCCLTrainerInitInfo fields",
    )
    check(
        field_names(ipc_engine.IPCWeightTransferInitInfo) == {"packed"}, "IPCWeightTransferInitInfo(packed)"
    )
    check(
        {"names", "dtype_names", "shapes", "ipc_handles"}
        <= field_names(ipc_engine.IPCWeightTransferUpdateInfo),
        "IPCWeightTransferUpdateInfo fields",
    )
    uid = bytes(range(128))
    info = nccl_common.NCCLWeightTransferInitInfo(**trainer.nccl_unique_id_init_info(uid, 2))
    check(info.nccl_unique_id_bytes == uid and info.packed, "nccl_unique_id_init_info parses, the id decodes")
    check(params(nccl_engine.NCCLTrainerWeightTransferEngine.send_weights) == ["self"], "send_weights()")
    check(
        callable(nccl_engine.NCCLTrainerWeightTransferEngine.shutdown),
        "NCCLTrainerWeightTransferEngine.shutdown",
    )

    # the trainer side's vLLM types
    check(
        packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES == trainer.PACKED_BUFFER_BYTES, "packed buffer default"
    )
    check(packed_tensor.DEFAULT_PACKED_NUM_BUFFERS == trainer.PACKED_NUM_BUFFERS, "packed buffers default")
    check(params(base.ParamMeta)[:3] == ["name", "dtype", "shape"], "ParamMeta(name, dtype, shape)")
    source = trainer.weight_source(torch.nn.Linear(2, 3))
    check(
        isinstance(source, base.WeightSource) and source.implements_iter_full(),
        "weight_source is a WeightSource",
    )
    check(
        [m.name for m in source.metadata] == [n for n, _ in source.iter_full()],
        "metadata order == iter_full order",
    )
    client = trainer._Client(lambda body: {}, backend="nccl", tensors=[], timeout_s=1.0)
    check(isinstance(client, base.VLLMWeightSyncClient), "gymbridge's client is a VLLMWeightSyncClient")

    # IPC: the rebuild arguments gymbridge encodes are rebuild_cuda_tensor's, device at index 6
    check(
        tuple(params(reductions.rebuild_cuda_tensor)) == backend._IPC_FIELDS,
        "rebuild_cuda_tensor's arguments",
    )
    check(
        "list_args[6] = device_index"
        in inspect.getsource(ipc_engine.IPCWeightTransferEngine.receive_weights),
        "vLLM's IPC engine overwrites argument 6 (the device)",
    )
    check(
        "rebuild_cuda_tensor" in inspect.getsource(reductions.reduce_tensor),
        "reduce_tensor -> rebuild_cuda_tensor",
    )
    return {"checked": len(checked), "problems": list(problems)}


# ---------------------------------------------------------------------- CPU stand-ins


class FakeStream:
    def synchronize(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None


class FakeEvent:
    def record(self, stream: Any = None) -> None:
        return None


class NoStreamTensor(torch.Tensor):
    """A CPU tensor on which ``record_stream`` (CUDA only) is a no-op."""

    def record_stream(self, stream: Any) -> None:  # type: ignore[override]
        return None


class TorchOnCPU(types.ModuleType):
    """``torch`` for vLLM's transfer modules with CUDA streams, events and device queries stubbed."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def cpu_torch() -> TorchOnCPU:
    shim = TorchOnCPU("torch")
    shim.accelerator = types.SimpleNamespace(  # type: ignore[attr-defined]
        current_device_index=lambda: 0,
        current_stream=FakeStream,
        synchronize=lambda *a: None,
        is_available=lambda: False,
    )
    shim.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        stream=lambda s: contextlib.nullcontext(),
        current_stream=lambda *a: FakeStream(),
        get_device_properties=lambda index: types.SimpleNamespace(uuid="GPU-0"),
    )
    shim.Event = FakeEvent  # type: ignore[attr-defined]
    shim.empty = lambda *a, **k: torch.empty(*a, **k).as_subclass(NoStreamTensor)  # type: ignore[attr-defined]
    return shim


def install_cpu_stand_ins() -> None:
    from vllm.distributed.weight_transfer import base, ipc_engine, packed_tensor

    shim = cpu_torch()
    packed_tensor.torch = shim
    packed_tensor._get_streams = lambda index, n: tuple(FakeStream() for _ in range(n))
    base.torch = shim
    ipc_engine.torch = shim


class Pipe:
    """An NCCL group of two ranks in one process: rank 0's broadcasts fill rank 1's."""

    def __init__(self) -> None:
        self.chunks: queue.Queue[torch.Tensor] = queue.Queue()
        self.sizes: list[int] = []
        self.init_info: Any = None

    def send(self, tensor: torch.Tensor) -> None:
        self.chunks.put(tensor.detach().clone().as_subclass(torch.Tensor))

    def receive(self, tensor: torch.Tensor) -> None:
        chunk = self.chunks.get(timeout=120)
        if chunk.numel() != tensor.numel() or chunk.dtype != tensor.dtype:
            raise RuntimeError(
                f"receiver expects {tensor.numel()} {tensor.dtype}, sender sent {chunk.numel()} {chunk.dtype}"
            )
        self.sizes.append(chunk.numel())
        tensor.copy_(chunk)


class SenderEnd:
    def __init__(self, pipe: Pipe) -> None:
        self.pipe = pipe

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        self.pipe.send(tensor)

    def destroy(self) -> None:
        return None

    close = destroy


class ReceiverEnd(SenderEnd):
    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        self.pipe.receive(tensor)


# ---------------------------------------------------------------------- packing


def cases() -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
    draw = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=draw)

    mixed = [
        ("w.f32", randn(3, 5)),
        ("w.bf16", randn(7).to(torch.bfloat16)),  # 14 bytes: what follows it is misaligned in this order
        ("ids.i64", torch.randint(-(2**40), 2**40, (4, 2), generator=draw)),
        ("mask.bool", torch.rand(5, generator=draw) > 0.5),
        ("w.t", randn(3, 4).t()),  # not contiguous
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("empty", torch.empty(0, 3)),
        ("w.f16", randn(2, 3).half()),
        ("q.i8", torch.randint(-128, 128, (9,), generator=draw, dtype=torch.int8)),
        ("u8", torch.randint(0, 256, (3,), generator=draw, dtype=torch.uint8)),
        ("i32", torch.randint(-1000, 1000, (5,), generator=draw, dtype=torch.int32)),
    ]
    bf16 = [(f"layers.{i}.w", randn(i + 1, 3).to(torch.bfloat16)) for i in range(6)]
    return [("mixed", mixed), ("bf16_layers", bf16)]


def unpack_with_vllm(named: list[tuple[str, torch.Tensor]], buffer_bytes: int) -> tuple[list[Any], list[int]]:
    """gymbridge's chunks through vLLM's ``packed_nccl_broadcast_consumer``: what it hands to load."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

    from gymbridge.trainer.vllm_transfer import packed_chunks, update_info

    pipe = Pipe()
    for _names, chunk in packed_chunks(named, buffer_bytes):
        pipe.send(chunk)
    info = update_info(named)
    meta = (
        (n, (s, getattr(torch, d)))
        for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"], strict=True)
    )
    got: list[tuple[str, torch.Tensor]] = []
    packed_nccl_broadcast_consumer(
        iterator=meta,
        group=ReceiverEnd(pipe),
        src=0,
        post_unpack_func=lambda ws: got.extend((n, t.as_subclass(torch.Tensor).clone()) for n, t in ws),
        buffer_size_bytes=buffer_bytes,
        num_buffers=2,
        device="cpu",
    )
    if not pipe.chunks.empty():
        raise RuntimeError("vLLM's receiver left chunks unread")
    return got, pipe.sizes


def check_packing() -> dict[str, Any]:
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    from gymbridge.trainer.vllm_transfer import packed_chunks, transfer_order

    results: list[dict[str, Any]] = []
    for label, named in cases():
        ordered = transfer_order(named)
        total = sum(t.numel() * t.element_size() for _, t in named)
        first = ordered[0][1].numel() * ordered[0][1].element_size()
        for buffer_bytes in (1, 7, first, 40, 64, total, 10 * total):
            got, sizes = unpack_with_vllm(ordered, buffer_bytes)
            equal = (
                [
                    n == m and t.dtype == u.dtype and t.shape == u.shape and torch.equal(t, u)
                    for (n, t), (m, u) in zip(ordered, got, strict=True)
                ]
                if len(got) == len(ordered)
                else [False]
            )
            ours = [c for _, c in packed_chunks(ordered, buffer_bytes)]
            theirs: list[torch.Tensor] = []
            source = iter(ordered)
            while (chunk := pack_tensors(source, lambda item: item[1], buffer_bytes)) is not None:
                theirs.append(chunk.packed_tensor)
            same_bytes = len(ours) == len(theirs) and all(
                torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)
            )
            results.append(
                {
                    "case": label,
                    "buffer_bytes": buffer_bytes,
                    "chunks": len(sizes),
                    "tensors_equal": all(equal) and len(got) == len(ordered),
                    "same_bytes_as_vllm": same_bytes,
                }
            )
    dtypes = sorted({str(t.dtype) for _, named in cases() for _, t in named})
    try:
        unpack_with_vllm(cases()[0][1], 1 << 20)  # one chunk: the int64 tensor lands at byte 74
        control = "unpacked"
    except RuntimeError as exc:
        control = f"{type(exc).__name__}: {str(exc)[:160]}"
    return {"results": results, "dtypes": dtypes, "state_dict_order_in_vllm": control}


# ---------------------------------------------------------------------- the round trip


def through_vllm(
    method: str, args: tuple[Any, ...], kwargs: Any
) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """A ``collective_rpc`` call as the engine core hands it on: vLLM's msgpack and argument conversion."""
    from vllm.v1.engine.core import EngineCore, EngineCoreProc
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    frames = MsgpackEncoder().encode((0, 1, "collective_rpc", (method, None, args, kwargs)))
    _, _, _, decoded = MsgpackDecoder().decode(frames)
    method_out, _timeout, rpc_args, rpc_kwargs = EngineCoreProc._convert_msgspec_args(
        EngineCore.collective_rpc, decoded
    )
    return method_out, tuple(rpc_args or ()), dict(rpc_kwargs or {})


def stub_worker(model: Any, vllm_config: Any) -> Any:
    """vLLM ``Worker``'s weight-transfer methods (unbound, its own code) plus gymbridge's extension,
    over one CPU model: what ``collective_rpc`` reaches in a real worker."""
    from vllm.v1.worker.gpu_worker import Worker

    from gymbridge.generation.vllm import WeightSyncWorkerExtension

    borrowed = {
        name: getattr(Worker, name)
        for name in (
            "init_weight_transfer_engine",
            "shutdown_weight_transfer_engine",
            "start_weight_update",
            "_start_weight_update",
            "update_weights",
            "finish_weight_update",
            "_check_weight_transfer_engine",
            "get_draft_model",
        )
    }
    cls = type("StubWorker", (WeightSyncWorkerExtension,), borrowed)
    worker = cls()
    worker.vllm_config = vllm_config
    worker.device = torch.device("cpu")
    worker.rank = 0
    worker.weight_transfer_engine = None
    worker._weight_update_active = False
    worker._weight_update_is_draft = False
    worker.model_runner = types.SimpleNamespace(
        model=model, get_model=lambda: model, get_draft_model=lambda: None, reset_lora_state=lambda: None
    )
    return worker


class OneWorkerEngine:
    """``AsyncLLM``'s surface as the sink uses it; the weight-transfer methods are ``AsyncLLM``'s own."""

    def __init__(self, worker: Any) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self.worker = worker
        self.calls: list[str] = []
        self.vllm_config = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(world_size=1), lora_config=None
        )
        self.model_config = types.SimpleNamespace(hf_config=None, max_model_len=512)
        for name in (
            "init_weight_transfer_engine",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
        ):
            setattr(self, name, types.MethodType(getattr(AsyncLLM, name), self))

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,  # noqa: ASYNC109 - AsyncLLM's signature
        args: tuple[Any, ...] = (),
        kwargs: Any = None,
    ) -> list[Any]:
        method, args, kwargs = through_vllm(method, args, kwargs)
        self.calls.append(method)
        return [await asyncio.to_thread(getattr(self.worker, method), *args, **kwargs)]

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(f"weight_version {version}")

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(f"pause {mode}")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    async def reset_encoder_cache(self) -> None:
        self.calls.append("reset_encoder_cache")


class Server:
    """The model server's ``/weights/*`` routes with ``transport: vllm``, as an httpx transport over a
    sink whose event loop runs in its own thread."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.bodies: list[dict[str, Any]] = []

    def handle(self, request: Any) -> Any:
        import httpx

        from gymbridge.errors import WeightSyncError

        body = json.loads(request.content)
        self.bodies.append(body)
        if body.get("transport") != "vllm":
            return httpx.Response(400, json={"message": "not vllm"})
        try:
            answer = asyncio.run_coroutine_threadsafe(self.sink.vllm_transfer(body), self.loop).result(300)
        except (ValueError, WeightSyncError) as exc:
            return httpx.Response(400, json={"message": str(exc)})
        return httpx.Response(200, json=answer)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def fake_reduce_tensor(registry: dict[bytes, torch.Tensor]) -> Any:
    def reduce_tensor(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
        handle = f"handle-{len(registry)}".encode()
        registry[handle] = tensor
        storage = tensor.untyped_storage()
        return None, (
            type(tensor),
            tensor.size(),
            tensor.stride(),
            tensor.storage_offset(),
            torch.storage.TypedStorage,
            tensor.dtype,
            0,
            handle,
            storage.nbytes(),
            0,
            False,
            b"ref",
            0,
            b"event",
            False,
        )

    return reduce_tensor


def fake_rebuild(registry: dict[bytes, torch.Tensor], seen: list[int]) -> Any:
    def rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
        seen.append(args[6])
        return registry[args[7]]

    return rebuild_cuda_tensor


def round_trip(root: str) -> dict[str, Any]:
    import httpx
    from torch.multiprocessing import reductions
    from vllm.distributed.weight_transfer import ipc_engine, nccl_common, nccl_engine
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration

    from gymbridge.generation.vllm import VLLMGenerator, VLLMWeightSink, checkpoint_name
    from gymbridge.generation.weights import named_weights
    from gymbridge.models.tiny_vlm import build_tiny_vlm
    from gymbridge.trainer import vllm_transfer

    v0 = build_tiny_vlm(0).model
    v0.config.save_pretrained(f"{root}/vlm")

    def loaded(source: Any) -> tuple[Any, Any]:
        """vLLM's model class for the tiny Qwen2-VL on the CPU, loaded with ``source``'s weights by its
        own ``load_weights`` (as the engine starts), and its ``VllmConfig``."""
        from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config

        model_config = ModelConfig(
            model=f"{root}/vlm", dtype="float32", max_model_len=512, skip_tokenizer_init=True
        )
        vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
        with set_current_vllm_config(vllm_config), torch.device("cpu"):
            model = Qwen2VLForConditionalGeneration(vllm_config=vllm_config, prefix="")
        model.load_weights(
            [(checkpoint_name(model, n), t.detach().clone()) for n, t in named_weights(source)]
        )
        return model, vllm_config

    def params_of(source: Any) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in loaded(source)[0].named_parameters()}

    def step(trainer: Any) -> None:
        """What an optimizer step does to the trainer's weights, here: every one changes."""
        with torch.no_grad():
            for param in trainer.parameters():
                param.mul_(-0.5).add_(0.01)

    trainer = copy.deepcopy(build_tiny_vlm(1).model)
    before, ref1 = params_of(v0), params_of(trainer)
    step(trainer)
    ref2 = params_of(trainer)
    vllm_transfer.unsupported_reason = lambda model: None  # the trainer's model is on the CPU here
    vllm_transfer._gpu_uuid = lambda device: "GPU-0"
    out: dict[str, Any] = {}
    for label, backend, use_vllm in (
        ("nccl_vllm_trainer", "nccl", True),
        ("nccl_gymbridge_trainer", "nccl", False),
        ("ipc", "ipc", False),
    ):
        model, vllm_config = loaded(v0)
        record_metadata_for_reloading(model)
        pipe = Pipe()

        def worker_group(init_info: Any, parallel_config: Any, pipe: Pipe = pipe) -> Any:
            pipe.init_info = init_info
            return ReceiverEnd(pipe)

        nccl_engine.worker_init_process_group = worker_group
        nccl_engine.NCCLTrainerWeightTransferEngine._open_trainer_endpoint = (
            lambda self, init_info, pipe=pipe: setattr(self, "model_update_group", SenderEnd(pipe))
        )
        vllm_transfer._open_torch_nccl = lambda uid, world_size, device, pipe=pipe: SenderEnd(pipe)
        vllm_transfer._new_unique_id = lambda: UNIQUE_ID
        registry: dict[bytes, torch.Tensor] = {}
        devices: list[int] = []
        reductions.reduce_tensor = fake_reduce_tensor(registry)
        ipc_engine.rebuild_cuda_tensor = fake_rebuild(registry, devices)

        worker = stub_worker(model, vllm_config)
        engine = OneWorkerEngine(worker)
        generator = VLLMGenerator("unused", engine=engine, load_processor=False)
        sink = VLLMWeightSink(generator)
        server = Server(sink)
        publisher = vllm_transfer.VLLMTransferPublisher(
            "http://model-server",
            backend=backend,
            use_vllm=use_vllm,
            buffer_bytes=65536,
            timeout_s=120,
            http=httpx.Client(transport=httpx.MockTransport(server.handle)),
        )
        published = copy.deepcopy(build_tiny_vlm(1).model)

        def mismatched(reference: dict[str, torch.Tensor], model: Any = model) -> list[str]:
            return sorted(n for n, p in model.named_parameters() if not torch.equal(p.detach(), reference[n]))

        try:
            publisher.publish(published, 1)
            after_v1 = mismatched(ref1)
            step(published)
            publisher.publish(published, 2)  # the group is kept (vLLM's trainer sends no metadata again)
            after_v2 = mismatched(ref2)
            rebuilt_v1_v2 = len(devices)
            failed: dict[str, Any] = {}
            if backend == "ipc":
                failed = failed_update(server, sink, engine, generator, worker)
                publisher.publish(published, 3)
                failed["mismatched_after_v3"] = mismatched(ref2)[:5]
            init_info = pipe.init_info
            updates = [b for b in server.bodies if b.get("step") == "update"]
            out[label] = {
                "backend": publisher.backend,
                "policy_version": generator.policy_version,
                "engine_class": type(worker.weight_transfer_engine).__name__,
                "params": len(before),
                "params_changed_by_v1": sum(not torch.equal(before[n], ref1[n]) for n in before),
                "params_changed_by_v2": sum(not torch.equal(ref1[n], ref2[n]) for n in before),
                "mismatched_after_v1": after_v1[:5],
                "mismatched_after_v2": after_v2[:5],
                "names_per_update": [len(b["update_info"].get("names") or ()) for b in updates],
                "chunks": len(pipe.sizes),
                "steps": [b.get("step") for b in server.bodies],
                "rpc": [c for c in engine.calls if not c.startswith("gymbridge_device")],
                "worker_rank": None
                if init_info is None
                else nccl_common._worker_group_rank(init_info.rank_offset, vllm_config.parallel_config),
                "unique_id_used": None if init_info is None else init_info.nccl_unique_id_bytes == UNIQUE_ID,
                "rendezvous": None
                if init_info is None
                else ("tcp" if init_info.master_port else "unique_id"),
                "ipc_rebuilt_v1_v2": rebuilt_v1_v2,
                "update_active_after": worker._weight_update_active,
                "failed_update": failed,
            }
        finally:
            publisher.close()
            server.close()
    return out


def failed_update(server: Server, sink: Any, engine: Any, generator: Any, worker: Any) -> dict[str, Any]:
    """The last IPC update again as version 3, with two tensors' handles swapped (shapes differ): vLLM's
    ``load_weights`` refuses it mid-update. Observed: the error, the version kept, the engine resumed."""
    body = copy.deepcopy(next(b for b in reversed(server.bodies) if b.get("step") == "update"))
    info = body["update_info"]
    first = info["shapes"][0]
    other = next(i for i, shape in enumerate(info["shapes"]) if shape != first)
    handles = info["ipc_handles"]
    handles[0], handles[other] = handles[other], handles[0]
    body["version"] = 3
    calls_before = len(engine.calls)
    try:
        asyncio.run_coroutine_threadsafe(sink.vllm_transfer(body), server.loop).result(300)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc)[:120]}"
    return {
        "error": error,
        "policy_version_after": generator.policy_version,
        "rpc_after": engine.calls[calls_before:],
        "update_active_after": worker._weight_update_active,
    }


def main() -> None:
    names = check_names()
    install_cpu_stand_ins()
    packing = check_packing()
    init_distributed()
    borrow_cpu_attention_selector()
    with tempfile.TemporaryDirectory() as root:
        trip = round_trip(root)
    print(json.dumps({"names": names, "checked": checked, "packing": packing, "round_trip": trip}))


if __name__ == "__main__":
    sys.exit(main())
