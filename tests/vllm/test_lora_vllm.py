"""A LoRA trainer's adapters through real vLLM 0.33.0's own LoRA path (``.venv-vllm``), on CPU.

The adapters are made here, with gymbridge's venv (peft, :func:`gymbridge.generation.lora.apply_lora`
on the tiny families, every adapter tensor drawn as if trained): the directories
:func:`~gymbridge.generation.lora.write_adapter_dir` writes and the tensors a trainer publishes. The
scripts (scripts/lora_loader.py, scripts/lora_sink.py) run vLLM's loader, its LoRA-wrapped layers
and its LoRA manager on them. What still needs a GPU (``AsyncLLM`` with ``enable_lora``, the
punica GPU kernels) is listed in docs/generation.md, "LoRA adapters on vLLM".
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from _vllm_venv import run_script

pytestmark = pytest.mark.timeout(1500)

FAMILIES = ("qwen2_vl", "gemma3", "internvl")
"""Three language-model layouts behind three vLLM mappers (Qwen2-VL's, Gemma 3's, InternVL's)."""
RANK = 8
TOKENS = 5


def lora_policy(family: str, *, vision: str = "frozen") -> Any:
    """The tiny ``family`` with LoRA applied as a trainer applies it (rank :data:`RANK`)."""
    from gymbridge.generation.lora import LoRAConfig, apply_lora
    from gymbridge.models.tiny_families import tiny_family_policy

    model = tiny_family_policy(family, 0)
    model.config.architectures = [type(model).__name__]  # the class vLLM resolves from config.json
    apply_lora(model, LoRAConfig(rank=RANK, vision=vision))  # type: ignore[arg-type]
    return model


def train(model: Any, seed: int, *, encoders: bool = False) -> None:
    """Draw every adapter tensor (``B`` starts at zero) and, with ``encoders``, every encoder weight."""
    from gymbridge.generation.weights import is_adapter_name

    draw = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter_name(name) or (encoders and param.requires_grad):
                param.copy_(0.1 * torch.randn(param.shape, generator=draw))


def peft_deltas(model: Any) -> dict[str, torch.Tensor]:
    """Each adapted module's output change (peft layer minus its base layer) on one input per width:
    ``{"<module>.x": [T, in], "<module>.delta": [T, out]}``."""
    from peft.tuners.lora import LoraLayer

    draw = torch.Generator().manual_seed(2)
    inputs: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        x = inputs.setdefault(base.in_features, torch.randn(TOKENS, base.in_features, generator=draw))
        with torch.no_grad():
            out[f"{name}.delta"] = module(x) - base(x)
        out[f"{name}.x"] = x.clone()
    return out


@pytest.fixture(scope="module")
def loader(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from safetensors.torch import save_file

    from gymbridge.generation.lora import adapter_file_name, lora_settings, write_adapter_dir
    from gymbridge.generation.weights import published_weights

    root = tmp_path_factory.mktemp("lora_loader")
    for family in FAMILIES:
        model = lora_policy(family)
        train(model, seed=1)
        model.config.save_pretrained(root / family / "model")
        tensors = {adapter_file_name(n): t for n, t in published_weights(model)}
        settings = lora_settings(model)
        assert settings is not None
        write_adapter_dir(root / family / "adapter", tensors, settings)
        save_file(peft_deltas(model), str(root / family / "deltas.safetensors"))
    (root / "families.json").write_text(json.dumps(FAMILIES))
    return run_script("lora_loader.py", str(root / "families.json"), cwd=root)


@pytest.fixture(scope="module")
def sink(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from safetensors.torch import save_file

    from gymbridge.generation.lora import lora_settings
    from gymbridge.generation.weights import is_adapter_name, published_weights

    root = tmp_path_factory.mktemp("lora_sink")
    model = lora_policy("qwen2_vl", vision="full")
    model.config.save_pretrained(root / "model")
    (root / "settings.json").write_text(json.dumps(lora_settings(model)))
    v0 = {n: t.clone() for n, t in published_weights(model) if is_adapter_name(n)}
    train(model, seed=1, encoders=True)
    v1 = {n: t.clone() for n, t in published_weights(model)}
    assert len(v1) > len(v0) > 20  # v1 carries the encoder's full tensors too
    save_file(v0, str(root / "v0.safetensors"))
    save_file(v1, str(root / "v1.safetensors"))
    return run_script("lora_sink.py", str(root), cwd=root)


@pytest.mark.parametrize("family", FAMILIES)
def test_vllms_lora_loader_takes_gymbridges_adapter_directory(loader: Any, family: str) -> None:
    """``PEFTHelper`` + ``LoRAModel.from_local_checkpoint`` (through the worker manager's
    ``_load_adapter``: expected modules, the model's ``hf_to_vllm_mapper``) load every adapter of the
    directory under vLLM's module names with their shapes, and ``add_adapter`` activates it."""
    out = loader[family]
    assert "error" not in out, out
    assert out["modules"] == 14 and out["names_match"] and out["shapes_match"], out
    assert all(n.startswith("language_model.model.layers.") for n in out["names"]), out
    assert out["adapters"] == [1]


@pytest.mark.parametrize("family", FAMILIES)
def test_vllms_lora_layers_change_outputs_as_the_trainers_peft_layers(loader: Any, family: str) -> None:
    """Every LoRA-wrapped projection of vLLM's language model (packed q/k/v and gate/up included),
    run on vLLM's CPU punica wrapper, adds exactly what the trainer's peft layer adds: the rank,
    the ``alpha / r`` scale and the packing agree."""
    out = loader[family]
    assert out["layers_checked"] == 8, out  # 2 layers x (qkv, o, gate_up, down)
    assert out["max_delta"] > 0.1 and out["max_delta_error"] < 1e-5, out


def test_vllm_refuses_an_adapter_above_max_lora_rank(loader: Any) -> None:
    assert "LoRA rank 8 is greater than max_lora_rank 1" in loader["qwen2_vl"]["rank_refused"]


def test_the_sink_refuses_what_the_engine_cannot_serve(sink: Any) -> None:
    """No LoRA on the engine, a rank above its ``max_lora_rank``, full tensors with ``vision: frozen``:
    each refused at ``init_group`` with what to change."""
    assert "started without LoRA: serve with --enable-lora" in sink["refused_without_lora"]
    assert "rank 32 exceeds this vLLM engine's max_lora_rank 16" in sink["refused_rank"]
    assert "31 full tensor(s) (model.visual.blocks.0" in sink["refused_frozen_full"]
    assert "in a LoRA publication with vision 'frozen': only adapters travel" in sink["refused_frozen_full"]


def test_version_0_adapters_go_to_add_lora_and_requests_carry_them(sink: Any) -> None:
    """Before the first publication requests run on the base; version 0 (adapters only) is written as
    an adapter directory, registered with vLLM's manager and carried by the next request; an
    adapter-only version resets no cache."""
    assert sink["base_request"] is True
    v0 = sink["v0"]
    assert v0["lora_request"] == ["gymbridge-1-v0", 1]
    assert v0["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert v0["registered"] == [1] and v0["request_carries"] == 1 and v0["policy_version"] == 0
    assert v0["cache_resets"] == 0
    assert sink["kv_keys_differ"] is True  # vLLM keys KV blocks by adapter: no stale block is reused


def test_full_tensors_go_to_load_weights_and_adapters_to_a_new_lora(sink: Any) -> None:
    """Version 1 (``vision: full``): the encoder's tensors land in vLLM's model through
    ``load_weights``, the adapters as a new ``LoRARequest`` whose weights vLLM holds as sent; full
    tensors reset the caches."""
    v1 = sink["v1"]
    assert v1["lora_request"] == ["gymbridge-2-v1", 2] and v1["request_carries"] == 2
    assert v1["policy_version"] == 1 and v1["cache_resets"] == 1
    assert v1["encoder_loaded"] is True and v1["adapter_values_equal"] is True


def test_a_request_in_flight_keeps_its_adapter_until_it_finishes(sink: Any) -> None:
    """The old adapter and its directory stay while a request carries it; it records the version of
    its submission; once it finishes, ``remove_lora`` drops the adapter and its directory goes."""
    v1, held = sink["v1"], sink["in_flight"]
    assert v1["registered_while_old_in_flight"] == [1, 2] and v1["old_dir_while_in_flight"] is True
    assert held["carried"] == 1 and held["policy_version"] == 0
    assert held["registered_after"] == [2] and held["old_dir_after"] is False
    assert held["removed"] == ["remove_lora 1"]


def test_a_publication_vllm_refuses_leaves_the_previous_adapter_serving(sink: Any) -> None:
    """An adapter vLLM's loader refuses (a tensor of the wrong width) fails the version; its directory
    and registration are removed and version 1 keeps serving."""
    broken = sink["broken"]
    assert broken["error"] is not None
    assert broken["serving"] == 2 and broken["policy_version"] == 1
    assert broken["registered"] == [2] and broken["dirs"] == ["gymbridge-2-v1"]


def test_update_weights_takes_a_lora_publication_in_band(sink: Any) -> None:
    """``VLLMGenerator.update_weights`` (buckets through ``collective_rpc``) registers the adapter the
    same way; the failed version's id is never reused."""
    out = sink["in_band"]
    assert out["loaded"] > 20 and out["serving"] == out["request_carries"] == 4
    assert out["policy_version"] == 3 and out["registered"] == [4]


def test_the_serve_flags_become_vllms_lora_engine_args() -> None:
    """``gymbridge model serve --backend vllm --enable-lora --max-lora-rank R`` starts the engine with
    vLLM's LoRA path (``max_loras`` 2: a version and the one before it); without ``--enable-lora``
    the other flags, and ``--enable-lora`` on the hf backend, are refused."""
    import argparse

    from gymbridge.errors import ConfigError
    from gymbridge.generation.cli import _vllm_lora_args, add_model_commands

    parser = argparse.ArgumentParser()
    add_model_commands(parser.add_subparsers(dest="command"))

    def engine_args(*flags: str) -> dict[str, Any]:
        return _vllm_lora_args(parser.parse_args(["serve", "--model", "m", *flags]))

    lora = ("--backend", "vllm", "--enable-lora", "--max-lora-rank", "32")
    assert engine_args(*lora) == {"enable_lora": True, "max_lora_rank": 32, "max_loras": 2}
    assert engine_args("--backend", "vllm") == {}
    with pytest.raises(ConfigError, match="add --enable-lora"):
        engine_args("--backend", "vllm", "--max-lora-rank", "32")
    with pytest.raises(ConfigError, match="--backend vllm"):
        engine_args("--enable-lora")
