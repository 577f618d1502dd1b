"""Run in .venv-vllm: a trainer's weights load into vLLM's own model classes.

For the tiny Qwen2-VL and the tiny Qwen2.5-Omni thinker (gymbridge.testing, saved as a Qwen2-VL
and a whole Qwen2.5-Omni checkpoint), vLLM's model class is built on the CPU from the saved config
and the tensors a trainer sends (``named_weights``, Hugging Face names) are loaded with the
model's own ``load_weights`` (its ``hf_to_vllm_mapper``, q/k/v and gate/up stacking), after
:func:`gymbridge.generation.vllm.checkpoint_name`, exactly as the worker extension does. Every
vLLM parameter must be loaded. The control loads the names as sent, without ``checkpoint_name``.

Prints ``{"<model>": {"sent", "loaded", "params", "not_loaded", "embedding_equal", "without_fix"}}``.
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
from typing import Any

import torch

from gymbridge.generation.vllm import checkpoint_name
from gymbridge.generation.weights import named_weights


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def borrow_cpu_attention_selector() -> None:
    """The CUDA wheel finds no device here (vLLM's "unspecified" platform), which picks no attention
    backend; its CPU platform would bind custom ops the CUDA wheel lacks. Layer construction, all
    that is needed for parameter names, gets the CPU platform's attention selector."""
    from vllm.platforms import current_platform
    from vllm.platforms.cpu import CpuPlatform

    type(current_platform).get_attn_backend_cls = CpuPlatform.get_attn_backend_cls


def build_vllm_model(model_dir: str, model_cls: Any) -> Any:
    """vLLM's model class for the checkpoint at ``model_dir``, built on the CPU (tiny: a few MB)."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config

    model_config = ModelConfig(model=model_dir, dtype="float32", max_model_len=512, skip_tokenizer_init=True)
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vllm_config), torch.device("cpu"):
        return model_cls(vllm_config=vllm_config, prefix="")


def check(hf_model: Any, model_dir: str, model_cls: Any) -> dict[str, Any]:
    """Load the trainer's weights into vLLM's model with its own ``load_weights``, as the worker does."""
    model = build_vllm_model(model_dir, model_cls)
    sent = [(name, tensor.detach().clone()) for name, tensor in named_weights(hf_model)]
    loaded = set(model.load_weights([(checkpoint_name(model, n), t) for n, t in sent]))
    params = dict(model.named_parameters())
    embed = next(n for n in params if n.endswith("embed_tokens.weight"))
    hf_embed = next(t for n, t in sent if n.endswith("embed_tokens.weight"))
    try:
        model.load_weights(sent)
        without_fix = "loaded"
    except Exception as exc:  # the bug's symptom, recorded for the test
        without_fix = f"{type(exc).__name__}: {str(exc)[:200]}"
    return {
        "sent": len(sent),
        "loaded": len(loaded),
        "params": len(params),
        "not_loaded": sorted(set(params) - loaded)[:10],
        "embedding_equal": bool(torch.equal(params[embed].detach(), hf_embed)),
        "without_fix": without_fix,
    }


def init_distributed() -> None:
    """A one-process gloo world, as vLLM's own CPU tests set it up (parallel layers read it)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)


def main() -> None:
    from gymbridge.models.tiny_omni import build_tiny_omni
    from gymbridge.models.tiny_vlm import build_tiny_vlm

    init_distributed()
    borrow_cpu_attention_selector()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as root:
        from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration

        vlm = build_tiny_vlm(0)
        vlm.model.config.save_pretrained(f"{root}/vlm")
        results["qwen2_vl"] = check(vlm.model, f"{root}/vlm", Qwen2VLForConditionalGeneration)

        from transformers import Qwen2_5OmniConfig
        from vllm.model_executor.models.qwen2_5_omni_thinker import (
            Qwen2_5OmniThinkerForConditionalGeneration,
        )

        omni = build_tiny_omni(0)
        whole = Qwen2_5OmniConfig(thinker_config=omni.model.config.to_dict(), enable_audio_output=False)
        whole.architectures = ["Qwen2_5OmniModel"]
        whole.save_pretrained(f"{root}/omni")
        results["qwen2_5_omni_thinker"] = check(
            omni.model, f"{root}/omni", Qwen2_5OmniThinkerForConditionalGeneration
        )
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
