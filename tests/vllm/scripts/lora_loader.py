"""Run in .venv-vllm: adapter directories gymbridge writes load through vLLM's own LoRA path.

The test (tests/vllm/test_lora_vllm.py) builds each tiny family with LoRA applied in gymbridge's venv
(peft), draws every adapter tensor, and writes per family: ``model/`` (the config vLLM builds its
model class from), ``adapter/`` (:func:`gymbridge.generation.lora.write_adapter_dir`, names from
:func:`~gymbridge.generation.lora.adapter_file_name`) and ``deltas.safetensors`` (each adapted module's
output change, peft layer minus its base layer, on one input per width). Here, per family:

* ``PEFTHelper.from_local_dir`` + ``validate_legal`` against vLLM's ``LoRAConfig``: accepted with
  ``max_lora_rank=16``, refused with a smaller one;
* vLLM's model class is built on the CPU and LoRA-wrapped by the worker's own manager
  (``LRUCacheWorkerLoRAManager.create_lora_manager``, as ``LoRAModelRunnerMixin.load_lora_model``
  does); ``_load_adapter`` (expected modules from the packed mapping, the model's
  ``hf_to_vllm_mapper`` rename, ``LoRAModel.from_local_checkpoint``) gives the module names and
  shapes; ``add_adapter`` activates it in a slot;
* each LoRA-wrapped language-model layer (packed ``qkv_proj`` / ``gate_up_proj`` included) runs
  on the CPU punica wrapper with its base weight zeroed: its output must be peft's delta.

CPU-only workarounds (what a GPU has): pinned host memory is switched off (``PIN_MEMORY``), and the
CPU platform's attention selector and punica wrapper are borrowed (the CUDA wheel finds no device).

Prints ``{"<family>": {"architecture", "modules", "names_match", "shapes_match", "rank_refused",
"layers_checked", "max_delta_error", "max_delta", "adapters"}}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from weight_names import borrow_cpu_attention_selector, init_distributed

RANK_LIMIT = 16
TOKENS = 5


def cpu_lora_platform() -> None:
    """Pinned memory needs a CUDA driver; the CUDA wheel's "unspecified" platform has no punica wrapper."""
    import vllm.lora.lora_model
    import vllm.lora.model_manager
    import vllm.utils.torch_utils
    from vllm.platforms import current_platform
    from vllm.platforms.cpu import CpuPlatform

    for module in (vllm.lora.lora_model, vllm.lora.model_manager, vllm.utils.torch_utils):
        module.PIN_MEMORY = False  # type: ignore[attr-defined]
    type(current_platform).get_punica_wrapper = CpuPlatform.get_punica_wrapper  # type: ignore[method-assign]


def lora_model(model_dir: str, max_lora_rank: int = RANK_LIMIT, max_loras: int = 2) -> tuple[Any, Any, Any]:
    """vLLM's model class for ``model_dir`` on the CPU, LoRA-wrapped by the worker's own manager:
    ``(model, worker_lora_manager, vllm_config)``."""
    from vllm.config import DeviceConfig, LoRAConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    from vllm.model_executor.model_loader.utils import get_model_architecture

    model_config = ModelConfig(model=model_dir, dtype="float32", max_model_len=512, skip_tokenizer_init=True)
    vllm_config = VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig(device="cpu"),
        lora_config=LoRAConfig(max_lora_rank=max_lora_rank, max_loras=max_loras),  # type: ignore[arg-type]
    )
    model_cls, _ = get_model_architecture(model_config)
    with set_current_vllm_config(vllm_config), torch.device("cpu"):
        model = model_cls(vllm_config=vllm_config, prefix="")
        manager = LRUCacheWorkerLoRAManager(vllm_config, torch.device("cpu"), model.embedding_modules)
        model = manager.create_lora_manager(model, vllm_config)
    return model, manager, vllm_config


def rank_refusal(adapter_dir: str) -> str:
    """``validate_legal`` accepts the adapter under the limit and refuses it under a smaller one."""
    from vllm.config import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_local_dir(adapter_dir, max_position_embeddings=None)
    helper.validate_legal(LoRAConfig(max_lora_rank=RANK_LIMIT))  # type: ignore[arg-type]
    try:
        helper.validate_legal(LoRAConfig(max_lora_rank=1))  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    return "accepted"


def check_family(root: Path) -> dict[str, Any]:
    from safetensors.torch import load_file
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.request import LoRARequest

    adapter_dir = str(root / "adapter")
    refused = rank_refusal(adapter_dir)
    model, manager, _ = lora_model(str(root / "model"))
    request = LoRARequest(lora_name="gymbridge-test", lora_int_id=1, lora_path=adapter_dir)
    lora = manager._load_adapter(request)  # the loader add_lora runs on every worker

    files = load_file(str(root / "adapter" / "adapter_model.safetensors"))
    rename = model.hf_to_vllm_mapper.get_rename_mapper()
    modules = {  # vLLM's module name <- the adapter file's module (base_model.model.<HF name>)
        rename._map_name(name.removeprefix("base_model.model.").rsplit(".", 2)[0]): name.rsplit(".", 2)[0]
        for name in files
    }
    shapes_match = all(
        tuple(lora.loras[m].lora_a.shape) == tuple(files[f"{f}.lora_A.weight"].shape)
        and tuple(lora.loras[m].lora_b.shape) == tuple(files[f"{f}.lora_B.weight"].shape)
        for m, f in modules.items()
        if m in lora.loras
    )
    names_match = set(lora.loras) == set(modules)

    manager.add_adapter(request)
    adapters = sorted(manager.list_adapters())
    lora_manager = manager._adapter_manager
    lora_manager.set_adapter_mapping(
        LoRAMapping(index_mapping=(1,) * TOKENS, prompt_mapping=(1,), is_prefill=True)
    )
    expected = load_file(str(root / "deltas.safetensors"))
    packed = lora_manager.packed_modules_mapping
    errors: list[float] = []
    largest = 0.0
    for name, layer in lora_manager.modules.items():
        prefix, last = name.rsplit(".", 1)
        parts = [f"{prefix}.{p}" for p in packed.get(last, [last])]
        if not all(p in modules for p in parts):
            continue  # a LoRA-capable layer the trainer put no adapter on
        hf = [modules[p].removeprefix("base_model.model.") for p in parts]
        x = expected[f"{hf[0]}.x"]
        for param in layer.base_layer.parameters():
            param.data.zero_()  # the base weight is not what this checks
        with torch.no_grad():
            out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        want = torch.cat([expected[f"{h}.delta"] for h in hf], dim=-1)
        errors.append(float((out - want).abs().max()))
        largest = max(largest, float(want.abs().max()))
    return {
        "architecture": type(model).__name__,
        "modules": len(lora.loras),
        "names": sorted(lora.loras)[:3],
        "names_match": names_match,
        "shapes_match": shapes_match,
        "rank_refused": refused,
        "adapters": adapters,
        "layers_checked": len(errors),
        "max_delta_error": max(errors, default=float("inf")),
        "max_delta": largest,
    }


def main() -> None:
    families: list[str] = json.loads(Path(sys.argv[1]).read_text())
    init_distributed()
    borrow_cpu_attention_selector()
    cpu_lora_platform()
    root = Path(sys.argv[1]).parent
    results: dict[str, Any] = {}
    for family in families:
        try:
            results[family] = check_family(root / family)
        except Exception as exc:  # recorded per family; the test names it
            results[family] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
