"""Shared-memory weight sync (``gymbridge.generation.shared_weights``): identical weights after
every swap, aliases kept, the handshake refusing foreign segments, nothing left in /dev/shm,
and ``transport: auto`` choosing and falling back. The cross-process path runs in
``test_weight_sync_process.py`` (its ``publisher`` fixture covers both transports)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gymbridge.errors import WeightSyncError
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.shared_weights import (
    SHM_DIR,
    SharedWeightsReader,
    SharedWeightsWriter,
    segment_offsets,
)
from gymbridge.generation.weights import TensorSpec, WeightReceiver, named_weights
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.testing.model_server import TESTING_WEIGHTS_SECRET, served_in_thread
from gymbridge.trainer.models import tiny_policy
from gymbridge.trainer.weight_sync import DistributedPublisher, is_loopback_url

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)")


def specs_of(model: torch.nn.Module) -> list[TensorSpec]:
    return [
        TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named_weights(model)
    ]


def nudged(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


class Tied(torch.nn.Module):
    """An embedding and a head over one Parameter (tied weights), plus a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(6))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.embed(ids) * self.scale)
        return out


class Target:
    """A ``WeightTarget``: the receiver swaps ``model``'s tensors under ``weights_lock``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.policy_version = 0
        self._lock = threading.Lock()

    @property
    def weights_lock(self) -> threading.Lock:
        return self._lock


def our_files() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("gymbridge-weights-")}


def test_every_swap_gives_the_written_weights_and_generation_agrees() -> None:
    gen = HFGenerator(tiny_policy(0), build_tiny_vlm(0).processor, max_model_len=256)
    receiver = WeightReceiver(gen)
    trainer = tiny_policy(0)
    writer = SharedWeightsWriter(specs_of(trainer))
    try:
        receiver.attach_shared(writer.names, writer.nonce, writer.specs)
        writer.unlink()
        for version in range(1, 4):  # segment 0, 1, then 0 again
            nudged(trainer, version)
            writer.write((version - 1) % 2, [t for _, t in named_weights(trainer)])
            receiver.swap_shared(version, (version - 1) % 2)
            assert gen.policy_version == version
            mine, theirs = gen.model.state_dict(), trainer.state_dict()
            assert mine.keys() == theirs.keys()
            assert all(torch.equal(mine[k], theirs[k]) for k in mine)
            ids = torch.tensor([[1, 5, 9, 3]])
            with torch.no_grad():
                assert torch.equal(gen.model(input_ids=ids).logits, trainer(input_ids=ids).logits)
    finally:
        receiver.close()
        writer.close()


def test_tied_weights_and_buffers_follow_the_swap_and_close_gives_private_copies() -> None:
    trainer, served = Tied(), Tied()
    target = Target(served)
    receiver = WeightReceiver(target)
    writer = SharedWeightsWriter(specs_of(trainer))
    try:
        receiver.attach_shared(writer.names, writer.nonce, writer.specs)
        with torch.no_grad():
            trainer.embed.weight.mul_(3.0)
            trainer.scale.fill_(2.0)
        writer.write(0, [t for _, t in named_weights(trainer)])
        receiver.swap_shared(7, 0)
        assert served.head.weight is served.embed.weight  # still one Parameter
        assert torch.equal(served.head.weight, trainer.embed.weight)
        assert torch.equal(served.scale, trainer.scale)
        ids = torch.tensor([1, 2, 3])
        assert torch.equal(served(ids), trainer(ids))
        assert target.policy_version == 7
    finally:
        receiver.close()  # back to private memory: writing the weights in place must work now
        writer.close()
    with torch.no_grad():
        served.embed.weight.add_(1.0)
        served.scale.add_(1.0)
    assert torch.equal(served.head.weight, trainer.embed.weight + 1.0)


def test_the_handshake_refuses_a_wrong_nonce_name_or_layout() -> None:
    model = Tied()
    specs = specs_of(model)
    writer = SharedWeightsWriter(specs)
    try:
        with pytest.raises(WeightSyncError, match="nonce"):
            SharedWeightsReader(writer.names, bytes(16), specs)
        with pytest.raises(WeightSyncError, match="two names"):
            SharedWeightsReader(["../../etc/passwd", writer.names[1]], writer.nonce, specs)
        with pytest.raises(WeightSyncError, match="two names"):
            SharedWeightsReader(writer.names[:1], writer.nonce, specs)
        other = [TensorSpec(s.name, s.shape, "float64") for s in specs]  # another size and digest
        with pytest.raises(WeightSyncError, match="bytes"):
            SharedWeightsReader(writer.names, writer.nonce, other)
        reader = SharedWeightsReader(writer.names, writer.nonce, specs)
        assert len(reader.views) == 2
        reader.close()
    finally:
        writer.close()
    assert not our_files() & set(writer.names)
    with pytest.raises(WeightSyncError, match="cannot open"):  # unlinked: nobody can map it any more
        SharedWeightsReader(writer.names, writer.nonce, specs)


def test_a_segment_readable_by_others_is_refused(tmp_path: Any) -> None:
    specs = specs_of(Tied())
    writer = SharedWeightsWriter(specs)
    try:
        os.chmod(os.path.join(SHM_DIR, writer.names[0]), 0o644)
        with pytest.raises(WeightSyncError, match="private regular file"):
            SharedWeightsReader(writer.names, writer.nonce, specs)
    finally:
        writer.close()


def _resident_kib(path: str) -> int:
    """Resident KiB of this process's mappings of ``path`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's first line
                inside = line.rstrip("\n").endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_regression_segments_are_resident_before_the_first_sync() -> None:
    """The segments were mapped without their pages, so the first sync into each paid a page fault
    per 4 KiB (1.4-3.5 s for 400 MiB under load, against 0.2-0.3 s for a later copy) and the
    generator's first forward after the swap faulted them in again. Both sides now map with the
    pages in place."""
    specs = [TensorSpec("w", (2, 1024, 1024), "float32")]  # 8 MiB
    writer = SharedWeightsWriter(specs)
    try:
        paths = [os.path.join(SHM_DIR, n) for n in writer.names]
        assert all(_resident_kib(p) >= 8 * 1024 for p in paths), [_resident_kib(p) for p in paths]
        reader = SharedWeightsReader(writer.names, writer.nonce, specs)
        assert all(_resident_kib(p) >= 2 * 8 * 1024 for p in paths)  # the writer's and the reader's
        reader.close()
    finally:
        writer.close()


def test_segment_offsets_are_aligned_and_disjoint() -> None:
    specs = [
        TensorSpec("a", (3,), "float32"),
        TensorSpec("b", (5, 7), "bfloat16"),
        TensorSpec("c", (), "int64"),
    ]
    offsets, size = segment_offsets(specs)
    assert all(o % 64 == 0 for o in offsets)
    ends = [o + n for o, n in zip(offsets, (12, 70, 8), strict=True)]
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:], strict=False)) and ends[-1] <= size


@pytest.mark.parametrize(
    ("url", "loopback"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://127.3.4.5:1", True),
        ("http://localhost:9", True),
        ("http://[::1]:9", True),
        ("http://10.0.0.2:8000", False),
        ("http://gpu-node:8000", False),
    ],
)
def test_loopback_urls(url: str, loopback: bool) -> None:
    assert is_loopback_url(url) is loopback


@pytest.fixture
def served() -> Iterator[tuple[str, WeightReceiver, HFGenerator]]:
    """A model server with weight updates on, in a thread of its own (the publisher is sync)."""
    gen = HFGenerator(tiny_policy(0), build_tiny_vlm(0).processor, max_model_len=256)
    receiver = WeightReceiver(gen)
    with served_in_thread(gen, receiver, timeout_s=30) as url:
        yield url, receiver, gen


def test_auto_takes_shared_memory_on_this_host_and_leaves_no_file(
    served: tuple[str, WeightReceiver, HFGenerator],
) -> None:
    url, receiver, gen = served
    before = our_files()
    publisher = DistributedPublisher(url, timeout_s=30, secret=TESTING_WEIGHTS_SECRET)
    try:
        trainer = nudged(tiny_policy(0), 1)
        publisher.publish(trainer, 1)
        assert publisher.transport == "shared_memory" and receiver.transport == "shared_memory"
        assert our_files() == before  # unlinked once the server mapped them
        assert all(
            torch.equal(a, b)
            for a, b in zip(gen.model.state_dict().values(), trainer.state_dict().values(), strict=True)
        )
        assert publisher.last_timings.keys() == {"pack_send_s", "load_s"}
    finally:
        publisher.close()


def test_auto_falls_back_to_the_broadcast_when_the_server_refuses_the_segments(
    served: tuple[str, WeightReceiver, HFGenerator], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, receiver, gen = served

    def elsewhere(*args: Any) -> None:  # what a server on another host (another /dev/shm) answers
        raise WeightSyncError("cannot open the shared-memory segment")

    monkeypatch.setattr(receiver, "attach_shared", elsewhere)
    publisher = DistributedPublisher(url, timeout_s=30, secret=TESTING_WEIGHTS_SECRET)
    try:
        trainer = nudged(tiny_policy(0), 2)
        publisher.publish(trainer, 1)
        assert publisher.transport == "broadcast"
        assert all(
            torch.equal(a, b)
            for a, b in zip(gen.model.state_dict().values(), trainer.state_dict().values(), strict=True)
        )
    finally:
        publisher.close()
    forced = DistributedPublisher(url, timeout_s=30, transport="shared_memory", secret=TESTING_WEIGHTS_SECRET)
    try:
        with pytest.raises(WeightSyncError, match=r"400.*cannot open"):
            forced.publish(trainer, 2)
    finally:
        forced.close()


def test_shared_memory_then_broadcast_then_shared_memory_on_one_server(
    served: tuple[str, WeightReceiver, HFGenerator],
) -> None:
    """Switching transports: the model gets private weights back before a broadcast writes them."""
    url, _, gen = served
    trainer = tiny_policy(0)
    for version, transport in enumerate(["shared_memory", "broadcast", "shared_memory"], start=1):
        publisher = DistributedPublisher(  # type: ignore[arg-type]
            url, timeout_s=30, transport=transport, secret=TESTING_WEIGHTS_SECRET
        )
        try:
            nudged(trainer, version)
            publisher.publish(trainer, version)
            assert gen.policy_version == version
            assert all(
                torch.equal(a, b)
                for a, b in zip(gen.model.state_dict().values(), trainer.state_dict().values(), strict=True)
            )
        finally:
            publisher.close()
