"""A run's Hugging Face export: ``RUN_DIR/export/`` at the end (``output.export: final``) and
``gymbridge export RUN_DIR --out DIR``; both load with ``from_pretrained`` holding the final
checkpoint's weights, and ``gymbridge train --model DIR`` takes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from run_helpers import SMALL, quiet_train, run_config

from gymbridge.cli import main
from gymbridge.safe_io import load_state


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, str]:
    """A 2-step tiny colour run (``output.export`` left at its default)."""
    run_dir = tmp_path_factory.mktemp("export_run") / "run"
    summary, text = quiet_train(run_config(run_dir, {**SMALL, "rollout.native": True}))
    return run_dir, summary, text


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    tensors, meta = load_state(run_dir / "checkpoints" / "step-000002.ckpt")
    assert meta["step"] == 2
    return {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}


def from_pretrained(path: Path, **kwargs: Any) -> Any:
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(
        str(path), local_files_only=True, **kwargs
    )


def test_a_run_ends_with_an_export_holding_its_final_checkpoints_weights(
    tiny_run: tuple[Path, Any, str],
) -> None:
    run_dir, summary, text = tiny_run
    export = run_dir / "export"
    assert summary.export_dir == str(export)
    assert "export: step 2 as a Hugging Face model (float32, " in text and str(export) in text
    weights = final_weights(run_dir)
    state = from_pretrained(export).state_dict()
    assert set(state) == set(weights)
    for name, value in weights.items():
        assert torch.equal(state[name], value), name


def test_train_takes_the_export_as_its_model(tiny_run: tuple[Path, Any, str]) -> None:
    """``gymbridge train --model RUN_DIR/export``: the config accepts it and the run's loader loads it."""
    from gymbridge.run import load_run_config
    from gymbridge.run.model import pick_model

    run_dir, _, _ = tiny_run
    export = str(run_dir / "export")
    assert load_run_config(["smoke"], [], {"model": export}).model.name == export
    model = pick_model(export, 0, ("image",))
    assert not model.tiny and model.placeholder_token_ids  # media ids from the exported config
    weights = final_weights(run_dir)
    policy = model.policy.state_dict()
    assert all(torch.equal(policy[n], v) for n, v in weights.items())
    rendered = model.processor.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user" in rendered  # the run's chat template came along


def test_export_none_writes_no_export(tmp_path: Path) -> None:
    settings = {**SMALL, "steps": 1, "rollout.native": True, "output.export": "none"}
    summary, text = quiet_train(run_config(tmp_path / "run", settings))
    assert summary.export_dir == "" and not (tmp_path / "run" / "export").exists()
    assert "export:" not in text


def test_cli_exports_a_step_in_bfloat16_shards(
    tiny_run: tuple[Path, Any, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _, _ = tiny_run
    out = tmp_path / "hf"
    argv = ["export", str(run_dir), "--out", str(out), "--dtype", "bfloat16", "--max-shard-size", "300KB"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert err.count("  shard ") == len(files) and "exported step 2 (step-000002.ckpt)" in err
    state = from_pretrained(out, dtype="auto").state_dict()
    for name, value in final_weights(run_dir).items():
        assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], value.to(torch.bfloat16))
    # a directory that holds something is refused (exit 2, one line naming the fix) unless --overwrite
    assert main(argv) == 2
    assert "not empty; give a new one, or --overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--step", "2"]) == 0
    assert main(["export", str(run_dir), "--out", str(tmp_path / "x"), "--step", "1"]) == 2
    assert "no checkpoint of step 1 (kept: step-000002.ckpt)" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "y")]) == 2
    assert "not a run directory (no config.yaml)" in capsys.readouterr().err


def test_cli_help_describes_export(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    out = capsys.readouterr().out
    for flag in ("--out", "--step", "--dtype", "--max-shard-size", "--overwrite", "from_pretrained"):
        assert flag in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "export" in capsys.readouterr().out


def test_a_run_on_a_model_directory_exports_with_that_directorys_processor(
    tiny_run: tuple[Path, Any, str], tmp_path: Path
) -> None:
    """``model.name: DIR``: the export takes DIR's config and copies its processor / tokenizer files."""
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.run import load_run_config
    from gymbridge.run.cli import run_model_parts
    from gymbridge.trainer.export import export_hf

    run_dir, _, _ = tiny_run
    model_dir = run_dir / "export"
    parts = run_model_parts(load_run_config(["smoke"], [], {"model": str(model_dir)}))
    assert (
        parts.processor_dir == model_dir and parts.model_class.__name__ == "Qwen2VLForConditionalGeneration"
    )
    export_hf(run_dir, tmp_path / "again", parts=parts)
    for name in (
        "tokenizer.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "generation_config.json",
    ):
        assert (tmp_path / "again" / name).read_bytes() == (model_dir / name).read_bytes(), name
    loaded = HFGenerator.from_pretrained(str(tmp_path / "again"), device="cpu")
    assert loaded.processor.image_token == "<|image_pad|>"
