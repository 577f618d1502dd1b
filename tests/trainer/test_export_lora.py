"""Export of a LoRA run (``gymbridge.trainer.export``): the peft adapter directory, and the merged model.

A LoRA checkpoint holds ``model.<name>`` for the published tensors only (the adapters under their
in-model names, the encoders' full tensors with ``vision: full``) and says ``"lora"`` in its JSON;
the base weights are the run's model source. The checkpoints here are written in that layout with
``gymbridge.safe_io`` (and one with ``gymbridge.trainer.checkpoint.save_checkpoint``), from a tiny
model whose adapters were moved off their initial values (``lora_B`` nonzero). The adapter must load
with ``PeftModel.from_pretrained`` and the merged model with ``from_pretrained``, each giving the
trained LoRA model's logits.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from export_helpers import FORMAT
from PIL import Image

from gymbridge.errors import CheckpointError, ConfigError
from gymbridge.generation.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoRAConfig,
    apply_lora,
    is_adapter_name,
    lora_settings,
    published_names,
)
from gymbridge.models.tiny_families import tiny_model
from gymbridge.safe_io import save_state
from gymbridge.trainer.export import (
    ADAPTER_DIR,
    INDEX_NAME,
    WEIGHTS_NAME,
    ModelParts,
    ShardWritten,
    checkpoint_lora,
    export_adapter,
    export_hf,
    export_run,
    module_weights,
)

MERGE_ATOL = 1e-5
"""fp32: the merged ``W + s * B @ A`` rounds once where the LoRA forward adds two products."""


def trained_lora(
    family: str, *, vision: str = "frozen", rank: int = 4, seed: int = 1, full_modules: tuple[str, ...] = ()
) -> Any:
    """The tiny ``family`` model with LoRA adapters, every trainable tensor moved (``lora_B`` nonzero;
    with ``vision: full`` the encoders too), in eval mode."""
    model = copy.deepcopy(tiny_model(family, 0).model)
    apply_lora(model, LoRAConfig(rank=rank, alpha=2.0 * rank + 3, vision=vision, full_modules=full_modules))
    draw = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=draw))
    return model.eval()


def published(model: Any) -> dict[str, torch.Tensor]:
    names = published_names(model)
    assert names is not None
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in names}


def write_lora_ckpt(path: Path, weights: dict[str, torch.Tensor], settings: Any, *, step: int = 2) -> Path:
    """A LoRA run checkpoint as the trainer writes it (``model.*`` published tensors, optimizer and
    RNG tensors beside them, ``"lora"`` in the JSON)."""
    tensors = {f"model.{k}": v for k, v in weights.items()}
    tensors["optim.0.exp_avg"] = torch.zeros(3)
    tensors["rng.torch"] = torch.get_rng_state()
    save_state(path, tensors, {"format": FORMAT, "step": step, "lora": settings})
    return path


def write_lora_run(root: Path, model: Any, *, settings: Any = None, step: int = 2) -> Path:
    ckpts = root / "checkpoints"
    ckpts.mkdir(parents=True)
    name = f"step-{step:06d}.ckpt"
    write_lora_ckpt(ckpts / name, published(model), settings or lora_settings(model), step=step)
    (ckpts / "latest.json").write_text(json.dumps({"format": FORMAT, "step": step, "state": name}))
    return root


def parts_of(family: str) -> ModelParts:
    tiny = tiny_model(family, 0)
    return ModelParts.of_model(tiny.model, tiny.processor, base_model=tiny.name)


def image_inputs(family: str) -> dict[str, torch.Tensor]:
    """One prompt with a 56 x 56 image through the family's processor (the encoder matters)."""
    tiny = tiny_model(family, 0)
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    image.putpixel((3, 5), (9, 7, 9))
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}
    ]
    text = tiny.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    images: list[Any] = [[image]] if family == "gemma3" else [image]
    batch = tiny.processor(text=[text], images=images, return_tensors="pt")
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}


def logits(model: Any, family: str) -> torch.Tensor:
    with torch.no_grad():
        return model(**image_inputs(family)).logits


def from_pretrained(path: Path) -> Any:
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(str(path), local_files_only=True).eval()


def peft_loaded(family: str, adapter_dir: Path) -> Any:
    from peft import PeftModel

    base = copy.deepcopy(tiny_model(family, 0).model)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


CASES = [("qwen2_vl", "frozen"), ("qwen2_vl", "full"), ("gemma3", "frozen"), ("internvl", "full")]


@pytest.mark.parametrize(("family", "vision"), CASES)
def test_the_adapter_loads_with_peft_and_gives_the_trained_lora_models_logits(
    family: str, vision: str, tmp_path: Path
) -> None:
    trained = trained_lora(family, vision=vision)
    run = write_lora_run(tmp_path / "run", trained)
    assert checkpoint_lora(run / "checkpoints" / "step-000002.ckpt") == lora_settings(trained)
    result = export_run(run, tmp_path / "out", parts=parts_of(family))
    out = tmp_path / "out"
    assert result.kind == "adapter" and result.adapter_dir == out and result.step == 2
    assert result.files == (ADAPTER_WEIGHTS,) and result.num_tensors == len(published(trained))
    files = set(os.listdir(out))
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "tokenizer.json", "chat_template.jinja"} <= files
    assert "config.json" not in files  # from_pretrained would take the folder for a model
    assert not list(tmp_path.glob(".out.*"))
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == tiny_model(family, 0).name
    assert config["r"] == 4 and config["lora_alpha"] == 11.0
    if vision == "full":
        assert config["modules_to_save"] == ["model.vision_tower" if family != "qwen2_vl" else "model.visual"]
    else:
        assert config["modules_to_save"] is None
    loaded = peft_loaded(family, out)
    want = logits(trained, family)
    diff = (logits(loaded, family) - want).abs().max().item()
    print(f"{family} vision={vision}: adapter (peft) vs trained LoRA max |diff| = {diff:.3g}")
    assert diff <= 1e-6
    assert (want - logits(tiny_model(family, 0).model, family)).abs().max() > 1e-3  # the adapters matter


@pytest.mark.parametrize(("family", "vision"), CASES)
def test_merge_writes_a_model_from_pretrained_loads_with_the_trained_outputs_and_the_adapter_inside(
    family: str, vision: str, tmp_path: Path
) -> None:
    trained = trained_lora(family, vision=vision)
    run = write_lora_run(tmp_path / "run", trained)
    out = tmp_path / "out"
    shards: list[ShardWritten] = []
    result = export_run(
        run, out, parts=parts_of(family), merge=True, max_shard_size="100KB", on_shard=shards.append
    )
    assert result.kind == "merged" and result.adapter_dir == out / ADAPTER_DIR
    assert len(result.files) == len(shards) > 1 and (out / INDEX_NAME).is_file()
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(os.listdir(out))
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= set(os.listdir(out / ADAPTER_DIR))
    merged = from_pretrained(out)
    assert type(merged) is type(tiny_model(family, 0).model)
    assert not any("lora" in n or "base_layer" in n for n in merged.state_dict())
    want = logits(trained, family)
    diff = (logits(merged, family) - want).abs().max().item()
    print(f"{family} vision={vision}: merged vs trained LoRA max |diff| = {diff:.3g}")
    assert diff <= MERGE_ATOL
    # the same as peft's own merge, tensor by tensor
    reference = peft_loaded(family, out / ADAPTER_DIR).merge_and_unload()
    state = merged.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.allclose(state[name], value, atol=1e-6, rtol=0), name


def test_a_head_trained_in_full_exports_as_modules_to_save_and_merges(tmp_path: Path) -> None:
    """``trainer.lora.full_modules: [lm_head]`` (smoke_lora's): the head goes into the adapter as peft's
    ``modules_to_save`` and replaces the base head in the merged model."""
    trained = trained_lora("qwen2_vl", full_modules=("lm_head",))
    run = write_lora_run(tmp_path / "run", trained)
    export_run(run, tmp_path / "adapter", parts=parts_of("qwen2_vl"))
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["modules_to_save"] == ["lm_head"]
    want = logits(trained, "qwen2_vl")
    assert (logits(peft_loaded("qwen2_vl", tmp_path / "adapter"), "qwen2_vl") - want).abs().max() <= 1e-6
    export_run(run, tmp_path / "merged", parts=parts_of("qwen2_vl"), merge=True)
    merged = from_pretrained(tmp_path / "merged")
    assert torch.equal(merged.lm_head.weight, trained.lm_head.weight)
    assert (logits(merged, "qwen2_vl") - want).abs().max() <= MERGE_ATOL


def test_the_export_at_a_runs_end_merges_into_the_policys_own_frozen_base(tmp_path: Path) -> None:
    """``ModelParts.of_model(policy)`` of the trained LoRA policy itself (a run's end): its base layers
    are the base; adapters and ``.base_layer.`` names never reach the merged model."""
    trained = trained_lora("qwen2_vl", vision="full")
    names = dict(module_weights(trained))
    assert not any(is_adapter_name(n) or ".base_layer." in n for n in names)
    assert set(names) == set(tiny_model("qwen2_vl", 0).model.state_dict())
    run = write_lora_run(tmp_path / "run", trained)
    parts = ModelParts.of_model(trained, tiny_model("qwen2_vl", 0).processor, base_model="tiny:qwen2_vl")
    export_run(run, tmp_path / "out", parts=parts, merge=True, dtype="bfloat16")
    merged = from_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "out" / ADAPTER_DIR / ADAPTER_WEIGHTS))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    diff = (logits(merged.float(), "qwen2_vl") - logits(trained, "qwen2_vl")).abs().max().item()
    assert diff < 0.1  # bf16 weights: close, not equal


def test_a_merge_streams_the_base_one_tensor_at_a_time(tmp_path: Path) -> None:
    """Shards are written while base tensors are still being pulled: at most one shard is held."""
    trained = trained_lora("qwen2_vl")
    run = write_lora_run(tmp_path / "run", trained)
    base = tiny_model("qwen2_vl", 0)
    shards: list[ShardWritten] = []
    shards_when_pulled: list[int] = []

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in base.model.state_dict().items():
            shards_when_pulled.append(len(shards))
            yield name, tensor

    parts = replace(parts_of("qwen2_vl"), base_weights=weights)
    export_hf(run, tmp_path / "out", parts=parts, max_shard_size=200_000, on_shard=shards.append)
    assert len(shards) >= 3 and shards_when_pulled[-1] == len(shards) - 1
    assert shards_when_pulled[0] == 0


def test_a_run_on_a_model_directory_merges_into_that_directorys_safetensors(tmp_path: Path) -> None:
    """``model.name: DIR``: the base comes from DIR's safetensors (hub names renamed as
    ``from_pretrained`` renames them), lazily; the adapter names DIR as its base."""
    from gymbridge.run import load_run_config
    from gymbridge.run.cli import run_model_parts

    tiny = tiny_model("qwen2_vl", 0)
    model_dir = tmp_path / "base"
    tiny.model.save_pretrained(str(model_dir), max_shard_size="200KB")
    tiny.processor.tokenizer.save_pretrained(str(model_dir))
    tiny.processor.image_processor.save_pretrained(str(model_dir))
    on_disk = json.loads((model_dir / INDEX_NAME).read_text())["weight_map"]
    assert any(n.startswith("model.layers.") for n in on_disk)  # a rename is needed to load them
    parts = run_model_parts(load_run_config(["smoke"], [], {"model": str(model_dir)}))
    trained = trained_lora("qwen2_vl")
    run = write_lora_run(tmp_path / "run", trained)
    export_run(run, tmp_path / "out", parts=parts, merge=True)
    diff = (logits(from_pretrained(tmp_path / "out"), "qwen2_vl") - logits(trained, "qwen2_vl")).abs().max()
    assert diff <= MERGE_ATOL
    config = json.loads((tmp_path / "out" / ADAPTER_DIR / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(model_dir.resolve())


def test_a_sharded_lora_checkpoint_folder_exports_through_iter_full_tensors(tmp_path: Path) -> None:
    """An FSDP run's ``step-<s>/`` folder: the same tensors, ``"lora"`` in its ``index.json`` meta."""
    from gymbridge.trainer import sharded_checkpoint

    trained = trained_lora("qwen2_vl", vision="full")
    folder = tmp_path / "run" / "checkpoints" / "step-000003"
    tensors = {f"model.{k}": v for k, v in published(trained).items()}
    meta = {"run_step": 3, "lora": lora_settings(trained)}
    sharded_checkpoint.save_sharded(folder, tensors, meta, rank=0, world_size=1)
    latest = {"format": FORMAT, "step": 3, "state": "step-000003", "kind": "sharded"}
    (folder.parent / "latest.json").write_text(json.dumps(latest))
    assert checkpoint_lora(folder) == lora_settings(trained)
    result = export_run(tmp_path / "run", tmp_path / "out", parts=parts_of("qwen2_vl"), merge=True)
    assert result.step == 3 and result.checkpoint == folder
    want = logits(trained, "qwen2_vl")
    assert (logits(from_pretrained(tmp_path / "out"), "qwen2_vl") - want).abs().max() <= MERGE_ATOL
    assert (
        logits(peft_loaded("qwen2_vl", tmp_path / "out" / ADAPTER_DIR), "qwen2_vl") - want
    ).abs().max() <= 1e-6


def test_save_checkpoints_lora_checkpoint_exports(tmp_path: Path) -> None:
    """The checkpoint a LoRA trainer writes (``save_checkpoint``) is what the export reads."""
    from gymbridge.trainer.checkpoint import save_checkpoint
    from gymbridge.trainer.grpo import GRPOConfig, GRPOTrainer

    trained = trained_lora("gemma3")
    trainer = GRPOTrainer(trained, GRPOConfig(lr=1e-3, lora=LoRAConfig(rank=4, alpha=11.0)))
    save_checkpoint(
        tmp_path / "run" / "checkpoints", step=5, policy_version=5, trainer=trainer, done_task_indices=[]
    )
    result = export_run(tmp_path / "run", tmp_path / "out", parts=parts_of("gemma3"))
    assert result.kind == "adapter" and result.step == 5
    diff = (logits(peft_loaded("gemma3", tmp_path / "out"), "gemma3") - logits(trained, "gemma3")).abs().max()
    assert diff <= 1e-6


@pytest.mark.parametrize("merge", [False, True])
def test_a_corrupt_lora_checkpoint_is_refused_naming_the_file_and_writes_nothing(
    merge: bool, tmp_path: Path
) -> None:
    run = write_lora_run(tmp_path / "run", trained_lora("qwen2_vl"))
    ckpt = run / "checkpoints" / "step-000002.ckpt"
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0x01
    ckpt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 mismatch") as err:
        export_run(run, tmp_path / "out", parts=parts_of("qwen2_vl"), merge=merge)
    assert err.value.path == str(ckpt)
    assert os.listdir(tmp_path) == ["run"]


def _other_rank(model: Any) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(8, v.shape[1]) if ".lora_A." in k else v for k, v in published(model).items()}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "no_such_module",
            "its LoRA settings do not fit Qwen2VLForConditionalGeneration: .*matches no linear layer",
        ),
        ("rank", r"LoRA weight .*lora_A.default.weight has shape \[8, \d+\], this model's adapters \(r=4, "),
        ("vision", r"LoRA adapters \(r=4, vision=full\): \d+ missing \(model.visual"),
        ("extra", "it has no model.language_model.layers.0.self_attn.q_proj.base_layer.weight"),
        ("malformed", "malformed LoRA settings: ValueError: r '4' is not a positive int"),
        ("other_family", r"adapters \(r=4, vision=full\): it has no model\.visual\."),
    ],
)
@pytest.mark.parametrize("merge", [False, True])
def test_lora_settings_or_tensors_that_do_not_fit_the_base_are_refused_before_anything_is_written(
    change: str, message: str, merge: bool, tmp_path: Path
) -> None:
    trained = trained_lora("qwen2_vl", vision="full" if change == "other_family" else "frozen")
    settings = dict(lora_settings(trained) or {})
    weights = published(trained)
    if change == "no_such_module":
        settings["target_modules"] = r".*\.qkv_proj"
    elif change == "rank":
        weights = _other_rank(trained)
    elif change == "vision":
        settings["vision"] = "full"
    elif change == "extra":
        weights["model.language_model.layers.0.self_attn.q_proj.base_layer.weight"] = torch.zeros(64, 64)
    elif change == "malformed":
        settings["r"] = "4"
    # other_family: a Qwen2-VL checkpoint exported as Gemma 3 (the tiny language models' adapters
    # have the same names and shapes; the encoders trained in full do not)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    write_lora_ckpt(tmp_path / "run" / "checkpoints" / "step-000002.ckpt", weights, settings)
    latest = {"format": FORMAT, "step": 2, "state": "step-000002.ckpt"}
    (tmp_path / "run" / "checkpoints" / "latest.json").write_text(json.dumps(latest))
    parts = parts_of("gemma3" if change == "other_family" else "qwen2_vl")
    with pytest.raises(CheckpointError, match=message) as err:
        export_run(tmp_path / "run", tmp_path / "out", parts=parts, merge=merge)
    assert err.value.path.endswith("step-000002.ckpt") and os.listdir(tmp_path) == ["run"]


def test_full_and_lora_exports_refuse_what_they_cannot_write(tmp_path: Path) -> None:
    from export_helpers import perturbed, write_run

    tiny = tiny_model("qwen2_vl", 0)
    full = write_run(tmp_path / "full", perturbed(tiny.model, 3))
    with pytest.raises(ConfigError, match="a full fine-tuning checkpoint"):
        export_adapter(full, tmp_path / "a", parts=parts_of("qwen2_vl"))
    result = export_run(
        full, tmp_path / "m", parts=parts_of("qwen2_vl"), merge=True
    )  # merge: nothing to merge
    assert result.kind == "full" and result.adapter_dir is None and (tmp_path / "m" / WEIGHTS_NAME).is_file()
    lora = write_lora_run(tmp_path / "lora", trained_lora("qwen2_vl"))
    no_base = ModelParts(type(tiny.model), tiny.model.config, tiny.model.generation_config, tiny.processor)
    with pytest.raises(ConfigError, match=r"merging needs ModelParts\.base_weights"):
        export_hf(lora, tmp_path / "b", parts=no_base)
    assert export_run(lora, tmp_path / "c", parts=no_base).kind == "adapter"  # an adapter needs no base
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---------------------------------------------------------------------------- the command line
def lora_run_dir(root: Path, trained: Any) -> Path:
    """A run directory of a tiny Qwen2-VL LoRA run: its ``config.yaml`` and one LoRA checkpoint."""
    from gymbridge.run import load_run_config
    from gymbridge.run.rundir import RunDir

    config = load_run_config(["smoke"], ["trainer.lora.rank=4"], {"model": "tiny:qwen2_vl"})
    write_lora_run(root, trained)
    RunDir(root).write_config(config.model_dump(mode="json"))
    return root


def test_cli_exports_a_lora_run_as_an_adapter_in_a_subprocess_and_merged_with_merge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gymbridge.cli import main

    trained = trained_lora("qwen2_vl")
    run = lora_run_dir(tmp_path / "run", trained)
    proc = subprocess.run(
        [sys.executable, "-m", "gymbridge.cli", "export", str(run), "--out", str(tmp_path / "adapter")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"to {tmp_path / 'adapter'} as a LoRA adapter (peft): " in proc.stderr
    want = logits(trained, "qwen2_vl")
    assert (logits(peft_loaded("qwen2_vl", tmp_path / "adapter"), "qwen2_vl") - want).abs().max() <= 1e-6

    argv = ["export", str(run), "--out", str(tmp_path / "merged"), "--merge", "--dtype", "float32"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "as a Hugging Face model (LoRA merged, the adapter in adapter/)" in err
    assert (logits(from_pretrained(tmp_path / "merged"), "qwen2_vl") - want).abs().max() <= MERGE_ATOL
    assert (tmp_path / "merged" / ADAPTER_DIR / ADAPTER_CONFIG).is_file()
    assert main(argv) == 2  # not empty: refused, one line naming the fix
    assert "not empty; give a new one, or --overwrite" in capsys.readouterr().err


def test_cli_help_describes_merge(capsys: pytest.CaptureFixture[str]) -> None:
    from gymbridge.cli import main

    with pytest.raises(SystemExit):
        main(["export", "--help"])
    out = capsys.readouterr().out
    assert "--merge" in out and "PeftModel.from_pretrained" in out and "DIR/adapter/" in out


def test_an_adapter_on_a_tied_weight_exports_as_an_adapter_but_is_not_merged(tmp_path: Path) -> None:
    """Gemma 3's ``lm_head`` is tied to its embeddings: merging an adapter into it would untie them
    (the export writes one of the two), so the merge is refused by name and writes nothing."""
    model = copy.deepcopy(tiny_model("gemma3", 0).model)
    apply_lora(model, LoRAConfig(rank=4, target_modules=("q_proj", "lm_head")))
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.05)
    model.eval()
    run = write_lora_run(tmp_path / "run", model)
    with pytest.raises(NotImplementedError, match=r"lm_head\.weight is tied to another weight"):
        export_run(run, tmp_path / "merged", parts=parts_of("gemma3"), merge=True)
    assert not (tmp_path / "merged").exists()
    export_run(run, tmp_path / "adapter", parts=parts_of("gemma3"))
    diff = (
        (logits(peft_loaded("gemma3", tmp_path / "adapter"), "gemma3") - logits(model, "gemma3")).abs().max()
    )
    assert diff <= 1e-6
