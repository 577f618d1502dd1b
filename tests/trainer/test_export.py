"""Hugging Face export (``gymbridge.trainer.export``): every tiny family loads back with its weights.

A checkpoint here is a ``checkpoints/`` folder written with ``gymbridge.safe_io`` as the trainer
writes it (``model.<state_dict name>``, optimizer and RNG tensors beside them, ``latest.json``);
tests/run/test_export_run.py exports a real run's (helpers: tests/trainer/export_helpers.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from export_helpers import FORMAT, parts_of, perturbed, write_run

from gymbridge.errors import CheckpointError, ConfigError
from gymbridge.models.tiny_families import TINY_FAMILIES, tiny_model
from gymbridge.trainer.export import (
    INDEX_NAME,
    WEIGHTS_NAME,
    ShardWritten,
    export_hf,
    find_checkpoint,
    hf_weight_names,
    write_hf_weights,
)


def load(path: Path, **kwargs: Any) -> Any:
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(
        str(path), local_files_only=True, **kwargs
    )


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_tiny_family_exports_what_from_pretrained_loads_with_the_trained_weights(
    family: str, tmp_path: Path
) -> None:
    tiny = tiny_model(family, 0)
    weights = perturbed(tiny.model, 1)
    run = write_run(tmp_path / "run", weights)
    shards: list[ShardWritten] = []
    result = export_hf(
        run, tmp_path / "out", parts=parts_of(tiny), max_shard_size="100KB", on_shard=shards.append
    )
    assert result.step == 2 and len(result.files) == len(shards) > 1
    files = set(os.listdir(tmp_path / "out"))
    assert {"config.json", "generation_config.json", INDEX_NAME, *result.files} <= files
    assert "tokenizer.json" in files and "chat_template.jinja" in files
    assert not list(tmp_path.glob(".out.*"))  # the staging folder is gone
    loaded = load(tmp_path / "out")
    assert type(loaded) is type(tiny.model)
    # the names are save_pretrained's own: the loaded model saves itself under the same ones
    reference = tmp_path / "save_pretrained"
    loaded.save_pretrained(reference, max_shard_size="100KB")
    index = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(json.loads((reference / INDEX_NAME).read_text())["weight_map"])
    assert set(index["weight_map"].values()) == set(result.files)
    state = loaded.state_dict()
    assert set(state) == set(weights)
    for name, value in weights.items():
        assert torch.equal(state[name], value), name


def test_regression_gemma3_vision_tower_is_written_under_the_hub_and_vllm_names(tmp_path: Path) -> None:
    """Bug: a Gemma 3 built from its config is saved as ``vision_tower.embeddings.*`` (transformers
    drops SigLIP's ``vision_model.`` prefix, and re-adds it only for a model it loaded); vLLM's Gemma 3
    loader knows ``vision_tower.vision_model.*`` only, the hub checkpoints' names."""
    tiny = tiny_model("gemma3", 0)
    names = {saved for saved, _ in filter(None, hf_weight_names(tiny.model).values())}
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in names
    assert not any(n.startswith("vision_tower.embeddings") for n in names)
    assert "language_model.model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied


def test_bfloat16_export_casts_float_weights_and_says_so_in_config(tmp_path: Path) -> None:
    tiny = tiny_model("qwen2_vl", 0)
    weights = perturbed(tiny.model, 2)
    result = export_hf(
        write_run(tmp_path / "run", weights), tmp_path / "out", parts=parts_of(tiny), dtype="bfloat16"
    )
    assert result.files == (WEIGHTS_NAME,) and not (tmp_path / "out" / INDEX_NAME).exists()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load(tmp_path / "out", dtype="auto")
    state = loaded.state_dict()
    for name, value in weights.items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], value.to(torch.bfloat16)), name
    assert tiny.model.dtype == torch.float32  # the run's own config and model are untouched
    assert getattr(tiny.model.config, "dtype", None) != torch.bfloat16


def test_step_picks_an_older_checkpoint_and_a_missing_one_is_named(tmp_path: Path) -> None:
    tiny = tiny_model("qwen2_vl", 0)
    weights = perturbed(tiny.model, 3)
    run = write_run(tmp_path / "run", weights, steps=(1, 2))
    assert find_checkpoint(run) == (run / "checkpoints" / "step-000002.ckpt", 2)
    result = export_hf(run, tmp_path / "out", parts=parts_of(tiny), step=1)
    assert result.step == 1 and result.checkpoint.name == "step-000001.ckpt"
    name = "model.language_model.embed_tokens.weight"
    assert torch.equal(load(tmp_path / "out").state_dict()[name], weights[name] - 1)
    with pytest.raises(
        CheckpointError, match=r"no checkpoint of step 7 \(kept: step-000001.ckpt, step-000002.ckpt"
    ):
        export_hf(run, tmp_path / "out7", parts=parts_of(tiny), step=7)


def test_a_corrupt_checkpoint_is_refused_naming_the_file_and_writes_nothing(tmp_path: Path) -> None:
    tiny = tiny_model("qwen2_vl", 0)
    run = write_run(tmp_path / "run", perturbed(tiny.model, 4))
    ckpt = run / "checkpoints" / "step-000002.ckpt"
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit inside the tensors
    ckpt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 mismatch") as err:
        export_hf(run, tmp_path / "out", parts=parts_of(tiny))
    assert err.value.path == str(ckpt)
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == ["run"]
    ckpt.write_bytes(bytes(data[:100]))  # truncated
    with pytest.raises(CheckpointError, match="truncated"):
        export_hf(run, tmp_path / "out", parts=parts_of(tiny))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("drop", "weights do not fit this model: 1 missing"),
        ("extra", "has no model.extra.weight"),
        ("shape", r"has shape \[3\], the model"),
    ],
)
def test_weights_that_do_not_fit_the_model_are_refused(change: str, message: str, tmp_path: Path) -> None:
    tiny = tiny_model("qwen2_vl", 0)
    weights = perturbed(tiny.model, 5)
    if change == "drop":
        del weights["lm_head.weight"]
    elif change == "extra":
        weights["model.extra.weight"] = torch.zeros(2)
    else:
        weights["model.visual.merger.ln_q.bias"] = torch.zeros(3)
    run = write_run(tmp_path / "run", weights)
    with pytest.raises(CheckpointError, match=message) as err:
        export_hf(run, tmp_path / "out", parts=parts_of(tiny))
    assert err.value.path.endswith("step-000002.ckpt") and not (tmp_path / "out").exists()


def test_a_non_empty_out_dir_is_refused_unless_overwrite(tmp_path: Path) -> None:
    tiny = tiny_model("qwen2_vl", 0)
    run = write_run(tmp_path / "run", perturbed(tiny.model, 6))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty; give a new one, or --overwrite"):
        export_hf(run, out, parts=parts_of(tiny))
    assert os.listdir(out) == ["notes.txt"]
    export_hf(run, out, parts=parts_of(tiny), overwrite=True)
    assert "notes.txt" not in os.listdir(out) and (out / WEIGHTS_NAME).is_file()
    (tmp_path / "empty").mkdir()
    export_hf(run, tmp_path / "empty", parts=parts_of(tiny))  # an empty directory is fine
    with pytest.raises(ConfigError, match="max_shard_size"):
        export_hf(run, tmp_path / "x", parts=parts_of(tiny), max_shard_size="lots")
    with pytest.raises(ConfigError, match="dtype 'float16'"):
        export_hf(run, tmp_path / "x", parts=parts_of(tiny), dtype="float16")


def test_shards_are_written_while_the_tensors_still_stream(tmp_path: Path) -> None:
    """No more than one shard's tensors are held: shard 1 is on disk before the last tensor is read."""
    tiny = tiny_model("qwen2_vl", 0)
    weights = perturbed(tiny.model, 7)
    shards_when_pulled: list[int] = []
    shards: list[ShardWritten] = []

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in weights.items():
            shards_when_pulled.append(len(shards))
            yield name, value

    names = hf_weight_names(tiny.model)
    result = write_hf_weights(
        stream(), tmp_path, names=names, dtype=torch.float32, max_shard_size=200_000, on_shard=shards.append
    )
    assert len(result.files) == len(shards) >= 3
    assert shards_when_pulled[-1] == len(shards) - 1  # all but the last were written before the end
    assert max(s.num_bytes for s in shards) <= 200_000 or any(s.num_tensors == 1 for s in shards)


def test_a_sharded_checkpoint_folder_is_read_through_iter_full_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint folder of ``gymbridge.trainer.sharded_checkpoint`` (``index.json``): whole policy
    tensors come from its ``iter_full_tensors`` (the optimizer state is not assembled); without
    that module the folder is refused by name."""
    from gymbridge.trainer import sharded_checkpoint

    tiny = tiny_model("qwen2_vl", 0)
    weights = perturbed(tiny.model, 8)
    folder = tmp_path / "run" / "checkpoints" / "step-000003"
    tensors = {f"model.{k}": v for k, v in weights.items()} | {"optim.lm_head.weight.exp_avg": torch.zeros(2)}
    sharded_checkpoint.save_sharded(folder, tensors, {"step": 3}, rank=0, world_size=1)
    latest = {"format": FORMAT, "step": 3, "state": "step-000003"}
    (folder.parent / "latest.json").write_text(json.dumps(latest))
    read: list[tuple[Path, str]] = []
    real = sharded_checkpoint.iter_full_tensors

    def spy(directory: Path, *, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
        read.append((Path(directory), prefix))
        yield from real(directory, prefix=prefix)

    monkeypatch.setattr(sharded_checkpoint, "iter_full_tensors", spy)
    result = export_hf(tmp_path / "run", tmp_path / "out", parts=parts_of(tiny))
    assert read == [(folder, "model.")] and result.step == 3 and result.checkpoint == folder
    state = load(tmp_path / "out").state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    monkeypatch.setitem(sys.modules, "gymbridge.trainer.sharded_checkpoint", None)  # an older gymbridge
    with pytest.raises(CheckpointError, match="cannot read that format") as err:
        export_hf(tmp_path / "run", tmp_path / "out2", parts=parts_of(tiny))
    assert err.value.path == str(folder)


async def test_the_model_servers_loader_generates_like_the_trained_weights(tmp_path: Path) -> None:
    """``gymbridge model serve --model DIR`` loads with ``build_generator``: same prompt ids, same tokens."""
    import argparse

    from gymbridge.generation.cli import build_generator
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.generation.types import SamplingConfig
    from gymbridge.trajectory.types import GenerationInput

    tiny = tiny_model("qwen2_vl", 0)
    weights = perturbed(tiny.model, 9)
    export_hf(write_run(tmp_path / "run", weights), tmp_path / "out", parts=parts_of(tiny))
    args = argparse.Namespace(
        model=str(tmp_path / "out"), tiny=False, tiny_omni=False, backend="hf", seed=0,
        max_model_len=None, no_reasoning_parser=False, suppress_token_id=[],
    )  # fmt: skip
    served = build_generator(args)
    trained = type(tiny.model)(tiny.model.config)
    trained.load_state_dict(weights)
    original = HFGenerator(trained.eval(), tiny.processor)
    inp = GenerationInput(prompt_token_ids=list(tiny.tokenizer("the colour is")["input_ids"]))
    sampling = SamplingConfig(max_tokens=6, seed=3)
    (got,), (want,) = await served.generate([inp], sampling), await original.generate([inp], sampling)
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_model_serve_cli_serves_an_export(tmp_path: Path) -> None:
    tiny = tiny_model("qwen2_vl", 0)
    export_hf(write_run(tmp_path / "run", perturbed(tiny.model, 10)), tmp_path / "out", parts=parts_of(tiny))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gymbridge.generation.cli",
            "serve",
            "--model",
            str(tmp_path / "out"),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--default-max-tokens",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("serving on http://127.0.0.1:"), line
        url = line.split()[2]
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 4
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
