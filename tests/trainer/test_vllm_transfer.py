"""The trainer side of vLLM's weight-transfer protocol (:mod:`gymbridge.trainer.vllm_transfer`), with no
vLLM in this venv: the packed wire format against a plain reference reader (property tests), the
placement rule, the JSON IPC handles, and the publisher's calls to a recording model server.

That vLLM's own receiver reads these chunks (and its engines load what the publisher sends) is
tested against real vLLM in tests/vllm/test_vllm_weight_transfer.py.
"""

from __future__ import annotations

import json
import queue
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gymbridge.errors import WeightSyncError
from gymbridge.generation.vllm import decode_ipc_handle, encode_ipc_handle
from gymbridge.generation.weights import PUBLISHED_NAMES_ATTR, published_weights
from gymbridge.trainer import vllm_transfer
from gymbridge.trainer.vllm_transfer import (
    VLLMTransferPublisher,
    choose_backend,
    nccl_unique_id_init_info,
    pack_chunk,
    packed_chunk_bounds,
    packed_chunks,
    transfer_order,
    unsupported_reason,
    update_info,
)

DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def tensor_of(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    draw = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=draw) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=draw).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=draw, dtype=dtype)


def read_chunks(
    chunks: list[torch.Tensor], info: dict[str, Any], buffer_bytes: int
) -> list[tuple[str, torch.Tensor]]:
    """The reference reader: each tensor's bytes at its offset, cut from the metadata alone."""
    dtypes = [getattr(torch, d) for d in info["dtype_names"]]
    sizes = [int(torch.Size(s).numel()) * d.itemsize for s, d in zip(info["shapes"], dtypes, strict=True)]
    out: list[tuple[str, torch.Tensor]] = []
    bounds = packed_chunk_bounds(sizes, buffer_bytes)
    assert len(bounds) == len(chunks)
    for (start, stop), chunk in zip(bounds, chunks, strict=True):
        assert chunk.dtype == torch.uint8 and chunk.numel() == sum(sizes[start:stop])
        offset = 0
        for i in range(start, stop):
            raw = chunk[offset : offset + sizes[i]].clone()
            out.append((info["names"][i], raw.view(dtypes[i]).reshape(info["shapes"][i])))
            offset += sizes[i]
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100), max_size=30), st.integers(1, 300))
def test_packed_chunks_close_after_the_tensor_that_passes_the_bound(
    sizes: list[int], buffer_bytes: int
) -> None:
    bounds = packed_chunk_bounds(sizes, buffer_bytes)
    assert [i for start, stop in bounds for i in range(start, stop)] == list(range(len(sizes)))
    for n, (start, stop) in enumerate(bounds):
        assert stop > start
        assert all(sum(sizes[start:i]) <= buffer_bytes for i in range(start + 1, stop))  # never closed early
        if n < len(bounds) - 1:
            assert sum(sizes[start:stop]) > buffer_bytes


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 400),
)
def test_packed_tensors_come_back_equal_in_every_dtype(specs: list[Any], buffer_bytes: int) -> None:
    named = []
    for i, (dtype, shape, transpose) in enumerate(specs):
        t = tensor_of(dtype, tuple(shape), i)
        named.append((f"t{i}", t.t() if transpose and t.dim() == 2 else t))
    ordered = transfer_order(named)
    chunks = [chunk for _, chunk in packed_chunks(ordered, buffer_bytes)]
    got = read_chunks(chunks, update_info(ordered), buffer_bytes)
    assert [n for n, _ in got] == [n for n, _ in ordered]
    for (_, want), (_, have) in zip(ordered, got, strict=True):
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 9)), min_size=1, max_size=16),
    st.integers(1, 200),
)
def test_transfer_order_puts_every_tensor_at_an_offset_its_dtype_can_view(
    specs: list[Any], buffer_bytes: int
) -> None:
    """vLLM's receiver views each tensor in place: its offset in the chunk must divide by its width.
    The order within one width is the state-dict order (layers stay together)."""
    named = [(f"t{i}", torch.zeros(n, dtype=dtype)) for i, (dtype, n) in enumerate(specs)]
    ordered = transfer_order(named)
    sizes = [t.numel() * t.element_size() for _, t in ordered]
    for start, stop in packed_chunk_bounds(sizes, buffer_bytes):
        offset = 0
        for i in range(start, stop):
            assert offset % ordered[i][1].element_size() == 0
            offset += sizes[i]
    for width in {t.element_size() for _, t in named}:
        same = [n for n, t in named if t.element_size() == width]
        assert [n for n, t in ordered if t.element_size() == width] == same


def test_regression_state_dict_order_misaligns_a_wider_tensor() -> None:
    """Control for the rule above: a 14-byte bf16 tensor before an int64 one puts it at byte 14."""
    named = [("w", torch.zeros(7, dtype=torch.bfloat16)), ("ids", torch.zeros(2, dtype=torch.int64))]
    chunk = pack_chunk(t for _, t in named)
    with pytest.raises(RuntimeError, match="divisible by 8"):
        chunk[14:30].view(torch.int64)
    assert [n for n, _ in transfer_order(named)] == ["ids", "w"]


def test_unique_id_init_info_is_what_vllms_worker_parses() -> None:
    import base64

    uid = bytes(range(128))
    info = nccl_unique_id_init_info(uid, 3, buffer_size_bytes=4096, num_buffers=2)
    assert base64.b64decode(info["nccl_unique_id_b64"], validate=True) == uid
    assert info["rank_offset"] == 1 and info["world_size"] == 3 and info["packed"] is True
    assert "master_address" not in info and "master_port" not in info  # one rendezvous mode only


@pytest.mark.parametrize(
    ("trainer", "workers", "expected"),
    [
        ("GPU-a", ["GPU-a"], "ipc"),
        ("GPU-a", ["GPU-a", "GPU-a"], "ipc"),
        ("GPU-a", ["GPU-b"], "nccl"),
        ("GPU-a", ["GPU-b", "GPU-c"], "nccl"),
        ("GPU-a", ["GPU-a", "GPU-b"], "mixed"),
        ("GPU-a", [""], "CUDA"),
        ("", ["GPU-b"], "CUDA"),
    ],
)
def test_backend_follows_the_placement(trainer: str, workers: list[str], expected: str) -> None:
    if expected in ("ipc", "nccl"):
        assert choose_backend(trainer, workers) == expected
        return
    with pytest.raises(WeightSyncError, match="broadcast" if expected == "mixed" else "CUDA"):
        choose_backend(trainer, workers)


def test_lora_and_cpu_models_keep_gymbridges_own_paths() -> None:
    model = torch.nn.Linear(2, 2)
    assert "CUDA" in (unsupported_reason(model) or "")
    setattr(model, PUBLISHED_NAMES_ATTR, frozenset({"weight"}))
    assert "LoRA" in (unsupported_reason(model) or "")


def ipc_args(handle: bytes = b"\x01" * 64) -> tuple[Any, ...]:
    """A CUDA IPC handle as ``reduce_tensor`` returns one (values made up; the fields and types real)."""
    return (
        torch.Tensor,
        torch.Size([3, 4]),
        (4, 1),
        0,
        torch.storage.TypedStorage,
        torch.bfloat16,
        0,
        handle,
        24,
        512,
        False,
        b"/torch_123_456",
        7,
        b"\x00" * 64,
        True,
    )


def test_ipc_handles_travel_as_json_and_come_back_equal() -> None:
    args = ipc_args()
    data = json.loads(json.dumps(encode_ipc_handle(args)))
    back = decode_ipc_handle(data)
    assert back == args
    assert isinstance(back[1], torch.Size)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tensor_cls", "os.system"),
        ("storage_cls", "Tensor"),
        ("dtype", "Tensor"),
        ("storage_device", True),
        ("storage_handle", "not base64!"),
        ("tensor_size", [-1]),
        ("requires_grad", 1),
    ],
)
def test_an_ipc_handle_names_only_torch_types(field: str, value: Any) -> None:
    data = encode_ipc_handle(ipc_args())
    data[field] = value
    with pytest.raises(ValueError):  # noqa: PT011 - the message names the field; any ValueError refuses
        decode_ipc_handle(data)
    with pytest.raises(ValueError, match="exactly the fields"):
        decode_ipc_handle({**encode_ipc_handle(ipc_args()), "extra": 1})


# ---------------------------------------------------------------------- the publisher


class RecordingServer:
    """The model server's ``/weights/*`` routes with ``transport: vllm``, recording each body and reading
    the packed broadcasts with the reference reader."""

    def __init__(self, gpu_uuids: list[str], comm: FakeComm) -> None:
        self.gpu_uuids = gpu_uuids
        self.comm = comm
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[str | None] = []
        self.received: list[list[tuple[str, torch.Tensor]]] = []
        self.buffer_bytes = 0
        self.refuse_update: str | None = None

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        self.headers.append(request.headers.get("Authorization"))
        assert body["transport"] == "vllm"
        if body["step"] == "probe":
            return httpx.Response(200, json={"gpu_uuids": self.gpu_uuids, "ranks": len(self.gpu_uuids)})
        if body["step"] == "init":
            assert request.url.path == "/weights/init_group"
            self.buffer_bytes = body["init_info"].get("packed_buffer_size_bytes", 0)
            return httpx.Response(200, json={"status": "ready", "backend": body["backend"]})
        assert request.url.path == "/weights/update"
        if self.refuse_update:
            return httpx.Response(400, json={"message": self.refuse_update})
        info = body["update_info"]
        if "ipc_handles" not in info:
            chunks = [self.comm.receive() for _ in range(self.comm.pending(info, self.buffer_bytes))]
            self.received.append(read_chunks(chunks, info, self.buffer_bytes))
        return httpx.Response(200, json={"status": "loaded", "version": body["version"], "seconds": 0.01})


class FakeComm:
    """Rank 0's end of an NCCL group: what it broadcasts, kept in order."""

    def __init__(self) -> None:
        self.sent: queue.Queue[torch.Tensor] = queue.Queue()
        self.closed = False

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.sent.put(tensor.clone())

    def receive(self) -> torch.Tensor:
        """The next broadcast, waiting for it (the server's update call runs while the trainer sends)."""
        return self.sent.get(timeout=30)

    def close(self) -> None:
        self.closed = True

    def pending(self, info: dict[str, Any], buffer_bytes: int) -> int:
        sizes = [
            int(torch.Size(s).numel()) * getattr(torch, d).itemsize
            for s, d in zip(info["shapes"], info["dtype_names"], strict=True)
        ]
        return len(packed_chunk_bounds(sizes, buffer_bytes))


@pytest.fixture
def on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeComm:
    """The CPU model stands for one on GPU ``GPU-0``; the NCCL group is a :class:`FakeComm`."""
    comm = FakeComm()
    monkeypatch.setattr(vllm_transfer, "unsupported_reason", lambda model: None)
    monkeypatch.setattr(vllm_transfer, "_gpu_uuid", lambda device: "GPU-0")
    monkeypatch.setattr(vllm_transfer, "_new_unique_id", lambda: b"\x07" * 128)
    monkeypatch.setattr(vllm_transfer, "_open_torch_nccl", lambda uid, world_size, device: comm)
    return comm


class Trainer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(7, 3)  # 84 bytes: a chunk closes after it at 64
        self.proj = torch.nn.Linear(3, 5).to(torch.bfloat16)
        self.register_buffer("steps", torch.tensor([3], dtype=torch.int64))


def publisher_for(server: RecordingServer, **kwargs: Any) -> VLLMTransferPublisher:
    http = httpx.Client(
        transport=httpx.MockTransport(server.handle), headers={"Authorization": "Bearer s3cret"}
    )
    return VLLMTransferPublisher("http://server", use_vllm=False, buffer_bytes=64, http=http, **kwargs)


def test_publisher_speaks_the_protocol_and_its_bytes_are_the_weights(on_a_gpu: FakeComm) -> None:
    server = RecordingServer(["GPU-1"], on_a_gpu)
    model = Trainer()
    publisher = publisher_for(server)
    publisher.publish(model, 0)
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    publisher.publish(model, 1)
    assert [b["step"] for b in server.bodies] == ["probe", "init", "update", "update"]
    assert all(h == "Bearer s3cret" for h in server.headers)
    init = server.bodies[1]
    assert init["backend"] == "nccl" and publisher.backend == "nccl"
    assert init["init_info"]["world_size"] == 2 and init["init_info"]["nccl_unique_id_b64"]
    assert [t["name"] for t in init["tensors"]] == [n for n, _ in published_weights(model)]
    assert [b.get("version") for b in server.bodies[2:]] == [0, 1]
    order = [n for n, _ in transfer_order(published_weights(model))]
    assert order == ["steps", "embed.weight", "proj.weight", "proj.bias"]  # widest elements first
    assert [[n for n, _ in received] for received in server.received] == [order, order]
    latest = dict(server.received[-1])
    for name, tensor in published_weights(model):
        assert torch.equal(latest[name], tensor), name
    assert not torch.equal(dict(server.received[0])["embed.weight"], latest["embed.weight"])
    assert publisher.syncs == 2 and publisher.last_bytes == sum(t.nbytes for _, t in published_weights(model))
    publisher.close()
    assert on_a_gpu.closed


def test_the_trainers_gpu_among_the_workers_means_ipc(
    on_a_gpu: FakeComm, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.multiprocessing import reductions

    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (None, ipc_args(bytes([t.numel()]) * 64)))
    server = RecordingServer(["GPU-0"], on_a_gpu)
    model = Trainer()
    publisher_for(server).publish(model, 4)
    init, update = server.bodies[1], server.bodies[2]
    assert init["backend"] == "ipc" and init["init_info"] == {"packed": False}
    info = update["update_info"]
    assert info["names"] == [n for n, _ in published_weights(model)]
    handles = info["ipc_handles"]
    assert len(handles) == len(info["names"]) and all(set(h) == {"GPU-0"} for h in handles)
    embed = handles[info["names"].index("embed.weight")]["GPU-0"]
    assert decode_ipc_handle(embed) == ipc_args(bytes([21]) * 64)  # its own handle: 21 elements
    assert on_a_gpu.sent.empty()  # nothing broadcast


def test_refusals_reach_the_trainer(on_a_gpu: FakeComm) -> None:
    server = RecordingServer(["GPU-1"], on_a_gpu)
    model = Trainer()
    publisher = publisher_for(server)
    publisher.publish(model, 2)
    with pytest.raises(WeightSyncError, match="older than the published 2"):
        publisher.publish(model, 1)
    with pytest.raises(WeightSyncError, match="another model object"):
        publisher.publish(Trainer(), 3)
    server.refuse_update = "vLLM's nccl weight update failed: AssertionError: shape"
    with pytest.raises(WeightSyncError, match="400: vLLM's nccl weight update failed"):
        publisher.publish(model, 3)
    assert publisher.version == 2


def test_a_mixed_placement_is_refused_before_any_init(on_a_gpu: FakeComm) -> None:
    server = RecordingServer(["GPU-0", "GPU-1"], on_a_gpu)
    with pytest.raises(WeightSyncError, match="share the trainer's GPU"):
        publisher_for(server).publish(Trainer(), 0)
    assert [b["step"] for b in server.bodies] == ["probe"]


def test_a_lora_model_is_refused_with_the_reason() -> None:
    server = RecordingServer(["GPU-1"], FakeComm())
    model = Trainer()
    setattr(model, PUBLISHED_NAMES_ATTR, frozenset({"proj.weight"}))
    with pytest.raises(WeightSyncError, match="LoRA"):
        publisher_for(server).publish(model, 0)
    assert server.bodies == []
