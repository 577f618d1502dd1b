"""``gymbridge export`` directories load through vLLM's own weight loader (``.venv-vllm``).

The export is written here, with gymbridge's venv and its transformers (what a user runs); the
script (scripts/export_load.py) builds vLLM's model class from each directory's ``config.json`` and
loads the files with ``DefaultModelLoader.load_weights``: the model's ``hf_to_vllm_mapper`` and
stacked-parameter mapping must place every exported tensor and leave no parameter unloaded.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from _vllm_venv import REPO_ROOT, run_script

VLLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "internvl")
"""The tiny families whose export vLLM serves as is (the Omni thinker alone is no vLLM architecture:
vLLM serves whole Qwen2.5-Omni checkpoints, ``thinker.*``)."""


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Any:
    sys.path.insert(0, str(REPO_ROOT / "tests" / "trainer"))
    from export_helpers import parts_of, perturbed, write_run

    from gymbridge.models.tiny_families import tiny_model
    from gymbridge.trainer.export import export_hf

    root = tmp_path_factory.mktemp("vllm_export")
    exports = {}
    for family in (*VLLM_FAMILIES, "qwen2_5_omni"):
        tiny = tiny_model(family, 0)
        run = write_run(root / family / "run", perturbed(tiny.model, 1))
        out = root / family / "export"
        export_hf(run, out, parts=parts_of(tiny), max_shard_size="200KB")  # shards + index, as big models
        exports[family] = str(out)
    (root / "exports.json").write_text(json.dumps(exports))
    return run_script("export_load.py", str(root / "exports.json"), cwd=root)


@pytest.mark.parametrize("family", VLLM_FAMILIES)
def test_vllm_loads_every_parameter_of_an_export(loaded: Any, family: str) -> None:
    out = loaded[family]
    assert "error" not in out, out
    assert out["loaded"] == out["params"] > 20 and out["embedding_equal"], out


def test_qwen2_vl_export_resolves_to_vllms_qwen2_vl_class(loaded: Any) -> None:
    assert loaded["qwen2_vl"]["architecture"] == "Qwen2VLForConditionalGeneration"


def test_the_omni_thinker_export_is_not_a_vllm_checkpoint(loaded: Any) -> None:
    """Documented in docs/export.md: vLLM takes whole Qwen2.5-Omni checkpoints, not the thinker alone."""
    assert "error" in loaded["qwen2_5_omni"]
