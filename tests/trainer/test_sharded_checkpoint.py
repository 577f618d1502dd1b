"""Sharded checkpoints of an FSDP2-sharded tiny Qwen2-VL on gloo ranks (gymbridge.trainer.sharded_checkpoint).

One module fixture trains the tiny policy for one AdamW step on 2 ranks, saves it, and writes
reference files (safetensors of the full tensors, made with ``DTensor.full_tensor()``, so
independent of the code under test) of the saved state and of the state one step later. The
tests load that checkpoint on 1 (plain model), 2 and 4 ranks, save on 1 and load on 2, and
corrupt copies of it. Ranks are processes started with ``torch.multiprocessing.spawn``, each
with one torch thread and a gloo group over a ``FileStore``; they build the policy from the tiny
model's config (``gymbridge.trainer.models.from_config``, no tokenizer), all the same way.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from gymbridge.errors import CheckpointError
from gymbridge.trainer.sharded_checkpoint import (
    INDEX_NAME,
    flatten_model_and_optimizer,
    is_complete,
    iter_full_tensors,
    load_sharded,
    read_meta,
    restore_model_and_optimizer,
    save_sharded,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LR = 1e-2


# ---------------------------------------------------------------------------- helpers (run in every rank)
@dataclass(frozen=True)
class Policy:
    """What a rank needs to build the tiny policy: its class and config (sent to the ranks)."""

    model_class: type[Any]
    config: Any


def _sharded_policy(config: Any, seed: int, world_size: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gymbridge.trainer.models import from_config

    torch.manual_seed(seed)
    model = from_config(config.model_class, config.config)
    mesh = init_device_mesh("cpu", (world_size,))
    for module in model.modules():
        if type(module).__name__ in model._no_split_modules:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int, *, image: bool
) -> None:
    """One AdamW step on a batch of its own for every (step, rank); without an image the vision
    tower gets no gradient, so AdamW makes no state for its parameters."""
    config: Any = model.config
    gen = torch.Generator().manual_seed(1000 * step + rank)
    text = torch.randint(0, 64, (10,), generator=gen).tolist()
    if not image:
        ids = torch.tensor([text])
        model(input_ids=ids, labels=ids).loss.backward()
    else:  # one 56x56 image: a 4x4 grid of 14-px patches, 4 tokens after the 2x2 merge
        vision = [config.vision_start_token_id, *[config.image_token_id] * 4, config.vision_end_token_id]
        ids = torch.tensor([vision + text])
        model(
            input_ids=ids,
            labels=ids,
            pixel_values=torch.randn(16, 3 * 2 * 14 * 14, generator=gen),
            image_grid_thw=torch.tensor([[1, 4, 4]]),
            mm_token_type_ids=(ids == config.image_token_id).long(),
        ).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], Any]:
    """Whole tensors (``full_tensor()``: a collective) and the scalar optimizer state."""
    from torch.distributed.tensor import DTensor

    tensors, meta = flatten_model_and_optimizer(model, optimizer)
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in tensors.items()
    }
    return full, meta["optimizer"]["scalars"]


def _save_reference(path: Path, state: tuple[dict[str, torch.Tensor], Any]) -> None:
    save_file(state[0], str(path))
    path.with_suffix(".json").write_bytes(orjson.dumps(state[1]))


def _load_reference(path: Path) -> tuple[dict[str, torch.Tensor], Any]:
    return load_file(str(path)), orjson.loads(path.with_suffix(".json").read_bytes())


def _assert_same_state(
    got: tuple[dict[str, torch.Tensor], Any], want: tuple[dict[str, torch.Tensor], Any]
) -> None:
    assert sorted(got[0]) == sorted(want[0])
    differ = [k for k in want[0] if not torch.equal(got[0][k], want[0][k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"
    assert got[1] == want[1]


def _uneven_tensors(world_size: int) -> dict[str, torch.Tensor]:
    """Dim-0 sizes that ``torch.chunk`` splits unevenly (and leaves empty on 4 ranks); a plain one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = _uneven_reference()
    out = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items() if k != "plain"}
    return {**out, "plain": full["plain"].clone()}


def _uneven_reference() -> dict[str, torch.Tensor]:
    return {
        "rows5": torch.arange(15, dtype=torch.float32).reshape(5, 3),
        "rows7": torch.arange(7, dtype=torch.int64) * 3,
        "bf16": torch.linspace(-1, 1, 6).reshape(3, 2).to(torch.bfloat16),
        "plain": torch.tensor([1.5, -2.0]),
    }


# ---------------------------------------------------------------------------- scenarios (one per spawn)
def _save_on_two(rank: int, world: int, out: Path, policy: Policy) -> None:
    model = _sharded_policy(policy, 0, world)
    optimizer = _optimizer(model)
    _train_step(model, optimizer, 1, rank, image=False)  # no vision-tower optimizer state in the save
    tensors, meta = flatten_model_and_optimizer(model, optimizer)
    save_sharded(out / "ckpt2", tensors, {**meta, "step": 1}, rank=rank, world_size=world)
    save_sharded(out / "uneven2", _uneven_tensors(world), {}, rank=rank, world_size=world)
    # a rank that fails makes every rank raise, and no index is written
    bad = {"c": torch.ones(2, dtype=torch.complex64) if rank == 1 else torch.ones(2)}
    with pytest.raises(TypeError if rank == 1 else CheckpointError):
        save_sharded(out / "failed2", bad, {}, rank=rank, world_size=world)
    assert not is_complete(out / "failed2")
    saved = _full_state(model, optimizer)
    _train_step(model, optimizer, 2, rank, image=True)
    after = _full_state(model, optimizer)
    if rank == 0:
        _save_reference(out / "ref_saved.safetensors", saved)
        _save_reference(out / "ref_step2.safetensors", after)


def _resume_on_two(rank: int, world: int, out: Path, policy: Policy) -> None:
    model = _sharded_policy(policy, 1, world)  # other initial weights: the load must overwrite them all
    optimizer = _optimizer(model)
    meta = restore_model_and_optimizer(model, optimizer, out / "ckpt2", rank=rank, world_size=world)
    assert meta["step"] == 1
    assert 0 < len(optimizer.state) < len(list(model.parameters()))  # the vision tower has none yet
    _assert_same_state(_full_state(model, optimizer), _load_reference(out / "ref_saved.safetensors"))
    _train_step(model, optimizer, 2, rank, image=True)  # the vision tower's first AdamW step
    _assert_same_state(_full_state(model, optimizer), _load_reference(out / "ref_step2.safetensors"))


def _load_on_four(rank: int, world: int, out: Path, policy: Policy) -> None:
    model = _sharded_policy(policy, 1, world)
    optimizer = _optimizer(model)
    restore_model_and_optimizer(model, optimizer, out / "ckpt2", rank=rank, world_size=world)
    _assert_same_state(_full_state(model, optimizer), _load_reference(out / "ref_saved.safetensors"))
    targets = {k: torch.zeros_like(v) for k, v in _uneven_tensors(world).items()}
    load_sharded(out / "uneven2", targets, rank=rank, world_size=world)
    for name, want in _uneven_reference().items():
        got = targets[name]
        full = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert torch.equal(full, want), name


def _save_on_one(rank: int, world: int, out: Path, policy: Policy) -> None:
    model = _sharded_policy(policy, 0, world)
    optimizer = _optimizer(model)
    _train_step(model, optimizer, 1, rank, image=True)
    assert len(optimizer.state) == len(list(model.parameters()))
    tensors, meta = flatten_model_and_optimizer(model, optimizer)
    save_sharded(out / "ckpt1", tensors, meta, rank=rank, world_size=world)
    _save_reference(out / "ref1.safetensors", _full_state(model, optimizer))


def _load_one_on_two(rank: int, world: int, out: Path, policy: Policy) -> None:
    model = _sharded_policy(policy, 1, world)
    optimizer = _optimizer(model)
    restore_model_and_optimizer(model, optimizer, out / "ckpt1", rank=rank, world_size=world)
    _assert_same_state(_full_state(model, optimizer), _load_reference(out / "ref1.safetensors"))


Scenario = Callable[[int, int, Path, Policy], None]


def _rank_main(rank: int, world: int, store: str, scenario: Scenario, out: str, policy: Policy) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks meet on loopback, whatever the host name resolves to
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        scenario(rank, world, Path(out), policy)
    finally:
        dist.destroy_process_group()


def _spawn(scenario: Scenario, world: int, out: Path, policy: Policy) -> None:
    store = out / f".store-{scenario.__name__}-{os.getpid()}"
    store.unlink(missing_ok=True)
    mp.spawn(_rank_main, args=(world, str(store), scenario, str(out), policy), nprocs=world, join=True)


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def policy() -> Policy:
    from gymbridge.trainer.models import tiny_policy

    model = tiny_policy(0)
    return Policy(type(model), model.config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, policy: Policy) -> Path:
    """A directory with ``ckpt2`` and ``uneven2`` (saved on 2 ranks) and the reference files."""
    out = tmp_path_factory.mktemp("sharded")
    _spawn(_save_on_two, 2, out, policy)
    return out


@pytest.fixture
def ckpt(saved: Path, tmp_path: Path) -> Path:
    """A private copy of the 2-rank checkpoint, to corrupt."""
    return Path(shutil.copytree(saved / "ckpt2", tmp_path / "ckpt2"))


def _plain_policy_and_optimizer(seed: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from gymbridge.trainer.models import tiny_policy

    model = tiny_policy(seed)
    return model, _optimizer(model)


# ---------------------------------------------------------------------------- resharding
def test_two_rank_checkpoint_resumes_on_two_ranks_bit_identical_to_a_run_that_did_not_stop(
    saved: Path, policy: Policy
) -> None:
    _spawn(_resume_on_two, 2, saved, policy)


def test_two_rank_checkpoint_loads_into_a_plain_model_on_one_rank(saved: Path) -> None:
    model, optimizer = _plain_policy_and_optimizer()
    meta = restore_model_and_optimizer(model, optimizer, saved / "ckpt2")
    assert meta["step"] == 1
    tensors, meta = flatten_model_and_optimizer(model, optimizer)
    got = ({k: v.detach() for k, v in tensors.items()}, meta["optimizer"]["scalars"])
    _assert_same_state(got, _load_reference(saved / "ref_saved.safetensors"))
    # and from memory into another plain model: copied, not shared
    other, other_optimizer = _plain_policy_and_optimizer(seed=2)
    restore_model_and_optimizer(other, other_optimizer, (tensors, meta))
    again, again_meta = flatten_model_and_optimizer(other, other_optimizer)
    _assert_same_state((again, again_meta["optimizer"]["scalars"]), got)
    assert all(again[k].data_ptr() != tensors[k].data_ptr() for k in tensors)
    targets = {k: torch.zeros_like(v) for k, v in _uneven_reference().items()}
    load_sharded(saved / "uneven2", targets, rank=0, world_size=1)
    for name, want in _uneven_reference().items():
        assert torch.equal(targets[name], want), name


def test_two_rank_checkpoint_loads_on_four_ranks_with_uneven_and_empty_shards(
    saved: Path, policy: Policy
) -> None:
    _spawn(_load_on_four, 4, saved, policy)


def test_one_rank_checkpoint_loads_on_two_ranks(tmp_path: Path, policy: Policy) -> None:
    _spawn(_save_on_one, 1, tmp_path, policy)
    assert sorted(p.name for p in (tmp_path / "ckpt1").iterdir()) == [
        INDEX_NAME,
        "rank-0-of-1.json",
        "rank-0-of-1.safetensors",
    ]
    _spawn(_load_one_on_two, 2, tmp_path, policy)


def test_iter_full_tensors_assembles_every_tensor_without_a_process_group(saved: Path) -> None:
    assert not dist.is_initialized()
    want, _ = _load_reference(saved / "ref_saved.safetensors")
    got = dict(iter_full_tensors(saved / "ckpt2"))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    weights = [name for name, _ in iter_full_tensors(saved / "ckpt2", prefix="model.")]
    assert weights == [k for k in got if k.startswith("model.")] and 0 < len(weights) < len(got)
    assert dict(iter_full_tensors(saved / "uneven2")).keys() == _uneven_reference().keys()
    assert all(torch.equal(v, _uneven_reference()[k]) for k, v in iter_full_tensors(saved / "uneven2"))


def test_each_rank_writes_only_its_own_slices(saved: Path) -> None:
    ref, _ = _load_reference(saved / "ref_saved.safetensors")
    halves = [load_file(str(saved / "ckpt2" / f"rank-{r}-of-2.safetensors")) for r in range(2)]
    name = "model.lm_head.weight"
    rows = ref[name].shape[0]
    assert torch.equal(halves[0][name], ref[name][: rows // 2])
    assert torch.equal(halves[1][name], ref[name][rows // 2 :])
    total = sum(v.numel() for v in ref.values())
    assert sum(v.numel() for half in halves for v in half.values()) == total


# ---------------------------------------------------------------------------- format and streaming
def test_a_plain_save_on_one_rank_is_a_standard_safetensors_file_whatever_the_bucket(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(33, 7),
        "b": torch.randn(8, 6).t(),  # not contiguous: streamed row by row
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "flags": torch.tensor([True, False, True]),
    }
    sizes = []
    for bucket_mb in (1e-5, 64.0):
        out = tmp_path / f"b{bucket_mb}"
        sizes.append(save_sharded(out, tensors, {"note": "x"}, rank=0, world_size=1, bucket_mb=bucket_mb))
        raw = load_file(str(out / "rank-0-of-1.safetensors"))
        assert all(torch.equal(raw[k], tensors[k]) for k in tensors if k != "empty")
        assert read_meta(out) == {"note": "x"}
    assert sizes[0] == sizes[1]
    first, second = (tmp_path / f"b{b}" / "rank-0-of-1.safetensors" for b in (1e-5, 64.0))
    assert first.read_bytes() == second.read_bytes()
    assert dict(iter_full_tensors(tmp_path / "b64.0")).keys() == tensors.keys()


def test_a_save_that_fails_midway_leaves_no_index_and_the_checkpoint_is_absent(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    save_sharded(out, {"a": torch.ones(3)}, {"step": 1}, rank=0, world_size=1)
    assert is_complete(out)

    class Exploding(dict[str, torch.Tensor]):
        def items(self) -> Any:
            yield "a", torch.ones(3)
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_sharded(out, Exploding(), {"step": 2}, rank=0, world_size=1)
    assert not is_complete(out)
    with pytest.raises(CheckpointError, match="did not complete") as info:
        load_sharded(out, {"a": torch.zeros(3)}, rank=0, world_size=1)
    assert info.value.path == str(out / INDEX_NAME)


def test_a_failing_rank_makes_every_rank_raise_and_leaves_no_index(saved: Path) -> None:
    # the raising happened in the ranks of the fixture; here what it left on disk
    assert (saved / "failed2").is_dir()
    assert not is_complete(saved / "failed2")
    assert not (saved / "failed2" / "rank-1-of-2.safetensors").exists()


def _save_growth_mib(method: str, out: Path) -> tuple[float, float]:
    """Peak RSS growth while one rank saves a 64 MiB strided shard (benchmarks/checkpoint_memory.py)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_memory.py"
    out.mkdir()
    args = ["--shard-mb", "64", "--tensors", "2", "--child", method, "strided", str(out)]
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=True)
    _, floor, growth, _ = (float(x) for x in result.stdout.split()[-4:])
    return floor, growth


def test_saving_a_shard_that_needs_copying_holds_one_bucket_of_host_memory(tmp_path: Path) -> None:
    floor, streamed = _save_growth_mib("save_sharded:1", tmp_path / "sharded")
    assert abs(floor) < 1  # the peak was reset to the resident set: the growth is the save's
    _, whole = _save_growth_mib("save_file", tmp_path / "whole")
    assert streamed < 4, f"save_sharded with 1 MiB buckets grew the RSS by {streamed} MiB"
    assert whole > 48, f"safetensors' save_file grew it by only {whole} MiB (the baseline is wrong)"


# ---------------------------------------------------------------------------- corruption
def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _corruptions() -> dict[str, Callable[[Path], str]]:
    def flipped_data(d: Path) -> str:
        path = d / "rank-1-of-2.safetensors"
        _flip_byte(path, path.stat().st_size - 5)
        return path.name

    def flipped_header(d: Path) -> str:
        _flip_byte(d / "rank-0-of-2.safetensors", 20)
        return "rank-0-of-2.safetensors"

    def truncated_data(d: Path) -> str:
        path = d / "rank-1-of-2.safetensors"
        path.write_bytes(path.read_bytes()[:-100])
        return path.name

    def missing_data(d: Path) -> str:
        (d / "rank-1-of-2.safetensors").unlink()
        return "rank-1-of-2.safetensors"

    def missing_rank_index(d: Path) -> str:
        (d / "rank-0-of-2.json").unlink()
        return "rank-0-of-2.json"

    def edited_rank_index(d: Path) -> str:
        path = d / "rank-1-of-2.json"
        path.write_bytes(path.read_bytes().replace(b'"offsets":[16', b'"offsets":[15', 1))
        return path.name

    def edited_index(d: Path) -> str:
        path = d / INDEX_NAME
        path.write_bytes(path.read_bytes().replace(b'\\"step\\":1', b'\\"step\\":7', 1))
        return INDEX_NAME

    def missing_index(d: Path) -> str:
        (d / INDEX_NAME).unlink()
        return INDEX_NAME

    return {
        f.__name__: f
        for f in (
            flipped_data,
            flipped_header,
            truncated_data,
            missing_data,
            missing_rank_index,
            edited_rank_index,
            edited_index,
            missing_index,
        )
    }


@pytest.mark.parametrize("corruption", sorted(_corruptions()))
def test_a_corrupt_checkpoint_raises_checkpoint_error_naming_the_file(ckpt: Path, corruption: str) -> None:
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    culprit = _corruptions()[corruption](ckpt)
    after = ckpt / culprit
    assert not after.exists() or after.read_bytes() != before[culprit]
    model, optimizer = _plain_policy_and_optimizer()
    with pytest.raises(CheckpointError) as info:
        restore_model_and_optimizer(model, optimizer, ckpt)
    assert info.value.path == str(ckpt / culprit)
    assert culprit in str(info.value)
    with pytest.raises(CheckpointError) as info:
        dict(iter_full_tensors(ckpt))
    assert info.value.path == str(ckpt / culprit)


def test_a_target_of_another_shape_raises_checkpoint_error_naming_the_rank_index(ckpt: Path) -> None:
    with pytest.raises(CheckpointError, match="lm_head") as info:
        load_sharded(ckpt, {"model.lm_head.weight": torch.zeros(3, 3)}, rank=0, world_size=1)
    assert Path(info.value.path).name == "rank-0-of-2.json"
    with pytest.raises(CheckpointError, match="holds no tensor"):
        load_sharded(ckpt, {"model.nope": torch.zeros(3)}, rank=0, world_size=1)


def test_loading_never_unpickles(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle or torch.load called while loading a checkpoint")

    model, optimizer = _plain_policy_and_optimizer()
    for owner, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(owner, name, refuse)
    restore_model_and_optimizer(model, optimizer, saved / "ckpt2")
    assert sum(1 for _ in iter_full_tensors(saved / "ckpt2")) > 0
    assert not any(p.suffix not in {".json", ".safetensors"} for p in (saved / "ckpt2").iterdir())
