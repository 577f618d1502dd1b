"""Run in .venv-vllm: a ``gymbridge export`` directory loads through vLLM's own weight loader.

The test (tests/vllm/test_vllm_export.py) exports a trained checkpoint of each tiny family with
gymbridge's venv (its transformers writes the names) and passes ``{family: export_dir}`` as a JSON
file. Here, for each directory, vLLM resolves the model class from its ``config.json``
(``get_model_architecture``), builds it on the CPU, and its ``DefaultModelLoader.load_weights``
reads the safetensors files (index and shards included) through the model's ``load_weights``
(``hf_to_vllm_mapper``, stacked q/k/v and gate/up) and checks that every parameter was loaded,
exactly as ``LLM(model=export_dir)`` loads a checkpoint.

Prints ``{"<family>": {"architecture", "loaded", "params", "embedding_equal"} | {"error"}}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from weight_names import borrow_cpu_attention_selector, init_distributed


def load_export(export_dir: str) -> dict[str, Any]:
    from safetensors import safe_open
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import get_model_architecture

    model_config = ModelConfig(model=export_dir, dtype="float32", max_model_len=512, skip_tokenizer_init=True)
    load_config = LoadConfig(load_format="safetensors")
    vllm_config = VllmConfig(
        model_config=model_config, load_config=load_config, device_config=DeviceConfig(device="cpu")
    )
    model_cls, arch = get_model_architecture(model_config)
    with set_current_vllm_config(vllm_config), torch.device("cpu"):
        model = model_cls(vllm_config=vllm_config, prefix="")
        loader = DefaultModelLoader(load_config)
        loader.load_weights(model, model_config)  # raises when a parameter was not loaded
    params = dict(model.named_parameters())
    embed = next(n for n in params if n.endswith("embed_tokens.weight"))
    saved: torch.Tensor | None = None
    for file in sorted(Path(export_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            name = next((k for k in f.keys() if k.endswith("embed_tokens.weight")), None)  # noqa: SIM118
            if name is not None:
                saved = f.get_tensor(name)
    return {
        "architecture": arch,
        "params": len(params),
        "loaded": len(params),
        "embedding_equal": saved is not None and bool(torch.equal(params[embed].detach(), saved)),
    }


def main() -> None:
    exports: dict[str, str] = json.loads(Path(sys.argv[1]).read_text())
    init_distributed()
    borrow_cpu_attention_selector()
    results: dict[str, Any] = {}
    for family, export_dir in exports.items():
        try:
            results[family] = load_export(export_dir)
        except Exception as exc:  # recorded per family; the test says which must load
            results[family] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
