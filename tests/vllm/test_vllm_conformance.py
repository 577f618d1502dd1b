"""gymbridge's vLLM backend against real vLLM 0.33.0 (``.venv-vllm``), on CPU.

Each test runs one script of ``scripts/`` inside the vLLM venv (``_vllm_venv.run_script``) and
asserts on the JSON it prints. What still needs a GPU (starting ``AsyncLLM``, NCCL between trainer
and vLLM) is listed in docs/generation.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _vllm_venv import VLLM_VERSION, run_script

# Each script imports vLLM (CUDA torch and all: ~20 s on an idle 2-core machine, minutes on a loaded
# one) and the model-building ones construct vLLM models on the CPU.
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def mm_processing(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return run_script("mm_processing.py", cwd=tmp_path_factory.mktemp("mm_processing"))


@pytest.fixture(scope="module")
def weight_names(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return run_script("weight_names.py", cwd=tmp_path_factory.mktemp("weight_names"))


def test_every_vllm_name_gymbridge_uses_exists_with_its_signature(tmp_path: Path) -> None:
    """Engine args, prompt and sampling types, outputs, collective_rpc, pause / resume, the cache
    resets, the worker-extension injection and the model-runner attribute, as gymbridge calls them."""
    out = run_script("api_conformance.py", cwd=tmp_path)
    assert out["vllm"] == VLLM_VERSION
    assert out["problems"] == [], out["problems"]
    assert len(out["checked"]) > 30


def test_regression_update_weights_survive_vllms_rpc_serialisation(tmp_path: Path) -> None:
    """Bug: tensors passed through ``collective_rpc`` reached the worker as msgpack lists.

    ``update_weights`` now sends each bucket as its JSON layout plus raw bytes; replayed through
    vLLM's own ``MsgpackEncoder`` / ``MsgpackDecoder`` and argument conversion, the worker
    extension loads every tensor with the sent values (bf16 included). The control shows a tensor
    argument arriving as a list, which is why tensors cannot go that way.
    """
    out = run_script("rpc_serialisation.py", cwd=tmp_path)
    assert out["methods"] == ["gymbridge_load_bucket"] and out["rpc_calls"] > 1
    assert out["tensors_loaded"] == out["tensors_sent"] == 3
    assert out["values_equal"] is True
    assert out["tensor_arrives_as"] == "list"


def test_trainer_weights_load_through_vllms_own_model_classes(weight_names: Any) -> None:
    """The tiny Qwen2-VL's and the tiny Qwen2.5-Omni thinker's weights, named as a trainer names
    them, load into vLLM's model classes with their own ``load_weights`` (``hf_to_vllm_mapper``,
    stacked q/k/v and gate/up) after ``checkpoint_name``: every vLLM parameter is loaded."""
    for model in ("qwen2_vl", "qwen2_5_omni_thinker"):
        out = weight_names[model]
        assert out["not_loaded"] == [] and out["loaded"] == out["params"] > 20, (model, out)
        assert out["embedding_equal"], (model, out)
    assert weight_names["qwen2_vl"]["without_fix"] == "loaded"  # no sub-model prefix to restore


def test_regression_omni_thinker_weights_map_to_vllms_language_model(weight_names: Any) -> None:
    """Bug: a trainer's Omni thinker names (``model.*``, ``lm_head.*``) stayed unmapped by vLLM's
    mapper, which knows only ``thinker.*``: ``load_weights`` raised. The control loads them as sent."""
    out = weight_names["qwen2_5_omni_thinker"]
    assert out["not_loaded"] == []
    assert out["without_fix"].startswith("ValueError: There is no module or parameter named 'model'")


def test_regression_prefix_cache_reset_with_running_requests(tmp_path: Path) -> None:
    """Bug: ``reset_prefix_cache()`` returns False while requests hold KV, and gymbridge ignored it.

    vLLM's own scheduler, with one request running: the plain reset is refused; the reset
    ``VLLMGenerator.swap_weights`` asks for (``reset_running_requests=True``) succeeds and puts the
    request back in the waiting queue, to be recomputed under the new weights."""
    out = run_script("prefix_cache_reset.py", cwd=tmp_path)
    assert out["running_before"] == 1
    assert out["plain_reset"] is False
    assert out["forced_reset"] is True and out["running_after"] == 0 and out["waiting_after"] == 1


def test_vllm_expands_gymbridges_prompts_to_the_recorded_ids(mm_processing: Any) -> None:
    """vLLM's own multimodal input processing (its renderer, as ``AsyncLLM.generate`` runs it, with the
    real Qwen2-VL / Qwen2.5-Omni HF processors) expands what ``VLLMGenerator`` sends for gymbridge's
    image, video and audio prompts to exactly the prompt ids gymbridge records."""
    out = mm_processing
    cases = [name for name in out if not name.endswith("_raw_layout")]
    assert {"qwen2_vl_video", "omni_video_and_audio", "omni_image_and_audio"} <= set(cases)
    for name in cases:
        assert out[name]["equal"], (name, out[name])


def test_regression_stereo_44k_audio_gets_vllms_placeholder_count(mm_processing: Any) -> None:
    """Bug: a 44.1 kHz stereo clip went to vLLM as samples x channels; vLLM resampled across the
    channels and counted other audio tokens than gymbridge, so the prompt check failed.
    Now it is sent mono at the feature extractor's rate; the control sends it as decoded."""
    out = mm_processing
    assert out["omni_audio_stereo_44k"]["equal"]
    control = out["omni_audio_stereo_44k_raw_layout"]
    assert not control["equal"] and control["vllm"] > control["recorded"]
