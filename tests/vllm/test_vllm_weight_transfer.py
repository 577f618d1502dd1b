"""vLLM's own weight-transfer protocol (``vllm.distributed.weight_transfer``) as gymbridge speaks it,
against real vLLM 0.33.0 (``.venv-vllm``) on CPU.

One script (scripts/weight_transfer.py) checks the names gymbridge calls, reads gymbridge's packed
chunks with vLLM's own receiver, and publishes through ``VLLMTransferPublisher`` into
``VLLMWeightSink`` over vLLM's engines, worker methods and a real vLLM model class. What only a GPU
proves (NCCL between processes, CUDA IPC, a live ``AsyncLLM``) is listed in docs/generation.md.
"""

from __future__ import annotations

from typing import Any

import pytest
from _vllm_venv import run_script

pytestmark = pytest.mark.timeout(1500)

TRAINER_SIDES = ("nccl_vllm_trainer", "nccl_gymbridge_trainer", "ipc")


@pytest.fixture(scope="module")
def transfer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return run_script("weight_transfer.py", cwd=tmp_path_factory.mktemp("weight_transfer"))


def test_every_vllm_weight_transfer_name_gymbridge_uses_exists_with_its_signature(transfer: Any) -> None:
    """``AsyncLLM``'s four methods, the request and info types with the fields gymbridge writes, the
    worker's methods, both factories, ``WeightSource``, ``rebuild_cuda_tensor``'s arguments."""
    names = transfer["names"]
    assert names["problems"] == [], names["problems"]
    assert names["checked"] >= 40


def test_gymbridges_packed_chunks_are_read_by_vllms_own_receiver(transfer: Any) -> None:
    """Every case (nine dtypes, a scalar, an empty and a transposed tensor; bounds from 1 byte to more
    than everything): vLLM's ``packed_nccl_broadcast_consumer`` asks for exactly gymbridge's chunk
    sizes and hands back equal tensors, and vLLM's ``pack_tensors`` writes the same bytes."""
    packing = transfer["packing"]
    assert len(packing["dtypes"]) == 9
    assert packing["results"], packing
    for result in packing["results"]:
        assert result["tensors_equal"], result
        assert result["same_bytes_as_vllm"], result
    chunk_counts = {r["chunks"] for r in packing["results"]}
    assert 1 in chunk_counts and max(chunk_counts) >= 5  # one chunk, and many boundaries


def test_regression_vllm_cannot_read_a_packed_tensor_at_a_misaligned_offset(transfer: Any) -> None:
    """Bug found here: vLLM's receiver views each tensor in place, so a 14-byte bf16 tensor followed by
    an int64 one (state-dict order) fails in vLLM; gymbridge packs the widest elements first."""
    assert "must be divisible by 8" in transfer["packing"]["state_dict_order_in_vllm"]


@pytest.mark.parametrize("side", TRAINER_SIDES)
def test_publisher_to_sink_loads_every_vllm_parameter(transfer: Any, side: str) -> None:
    """Two versions through ``VLLMTransferPublisher`` -> ``VLLMWeightSink`` -> ``AsyncLLM``'s methods ->
    vLLM's worker methods and engine -> the layerwise reload of vLLM's Qwen2-VL: every parameter
    equals what ``load_weights`` makes of the same weights, after each version."""
    out = transfer["round_trip"][side]
    assert out["params_changed_by_v1"] > 0 and out["params_changed_by_v2"] == out["params"]
    assert out["mismatched_after_v1"] == [] and out["mismatched_after_v2"] == []
    assert out["policy_version"] == (3 if side == "ipc" else 2)
    assert out["steps"][:3] == ["probe", "init", "update"]
    assert out["update_active_after"] is False
    round_of_calls = [
        "pause keep",
        "start_weight_update",
        "gymbridge_update_weights_ipc" if side == "ipc" else "update_weights",
        "finish_weight_update",
        "reset_prefix_cache",
        "reset_encoder_cache",
        "resume",
    ]
    rpc = out["rpc"]
    assert rpc[:3] == [
        "gymbridge_checkpoint_names",
        "gymbridge_use_weight_transfer",
        "init_weight_transfer_engine",
    ]
    assert rpc[3:10] == round_of_calls


def test_nccl_sides_join_as_vllm_expects(transfer: Any) -> None:
    """vLLM's trainer engine rendezvouses over its TCPStore and sends the metadata once; gymbridge's
    own sender mints the unique id vLLM's ``nccl_unique_id_b64`` mode takes. The worker is rank 1."""
    vllm_side = transfer["round_trip"]["nccl_vllm_trainer"]
    own_side = transfer["round_trip"]["nccl_gymbridge_trainer"]
    assert vllm_side["rendezvous"] == "tcp" and own_side["rendezvous"] == "unique_id"
    assert own_side["unique_id_used"] is True
    assert vllm_side["worker_rank"] == own_side["worker_rank"] == 1
    assert vllm_side["engine_class"] == own_side["engine_class"] == "NCCLWeightTransferEngine"
    assert vllm_side["names_per_update"][1] == 0  # vLLM's engine reuses the metadata it sent
    assert own_side["names_per_update"][0] == own_side["names_per_update"][1] > 0
    assert vllm_side["chunks"] == own_side["chunks"] > 2


def test_ipc_rebuilds_every_tensor_from_json_handles(transfer: Any) -> None:
    """The IPC handles travel as JSON (no pickle): vLLM's ``IPCWeightTransferEngine`` rebuilds each."""
    out = transfer["round_trip"]["ipc"]
    assert out["engine_class"] == "IPCWeightTransferEngine"
    assert out["ipc_rebuilt_v1_v2"] == sum(out["names_per_update"][:2]) > 0


def test_a_failed_vllm_update_keeps_the_version_and_resumes(transfer: Any) -> None:
    """vLLM's loader refuses an update mid-way (two handles swapped): the sink ends vLLM's update
    (``gymbridge_abort_weight_update``), resumes generation, keeps the version; the next one loads."""
    failed = transfer["round_trip"]["ipc"]["failed_update"]
    assert failed["error"].startswith("WeightSyncError") and "Attempted to load weight" in failed["error"]
    assert failed["policy_version_after"] == 2
    assert failed["rpc_after"][-2:] == ["gymbridge_abort_weight_update", "resume"]
    assert failed["update_active_after"] is False
    assert failed["mismatched_after_v3"] == []
