"""Run in .venv-vllm: vLLM's scheduler refuses a plain prefix-cache reset while requests run.

This is what ``AsyncLLM.reset_prefix_cache()`` ends in (``EngineCore.reset_prefix_cache`` ->
``Scheduler.reset_prefix_cache``). With one request scheduled (its KV blocks held), the plain
reset returns ``False`` (what gymbridge ignored before) and the reset ``VLLMGenerator`` asks for,
``reset_running_requests=True``, returns ``True`` and puts the request back in the waiting queue
(it is recomputed under the new weights). Built on the tiny Qwen2-VL's text config; no model runs.

Prints ``{"plain_reset": bool, "running_before": n, "forced_reset": bool, "waiting_after": n}``.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch


def main() -> None:
    from transformers import Qwen2Config
    from vllm import SamplingParams
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from gymbridge.models.tiny_vlm import build_tiny_vlm

    block = 16
    with tempfile.TemporaryDirectory() as root:
        text = build_tiny_vlm(0).model.config.text_config  # text-only: no media processor needed
        Qwen2Config(**{**text.to_dict(), "architectures": ["Qwen2ForCausalLM"]}).save_pretrained(root)
        model_config = ModelConfig(model=root, dtype="float32", max_model_len=512, skip_tokenizer_init=True)
        vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=512,
                max_model_len=512,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(
                block_size=block, enable_prefix_caching=True, num_gpu_blocks_override=64
            ),
            device_config=DeviceConfig(device="cpu"),
        )
        vllm_config.cache_config.num_gpu_blocks = 64  # what the engine sets after profiling
        spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float32)
        kv_cache_config = KVCacheConfig(
            num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
        )
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block,
        )
        init_none_hash(sha256)
        request = Request(
            request_id="r0",
            prompt_token_ids=list(range(1, 41)),
            sampling_params=SamplingParams(max_tokens=8),
            pooling_params=None,
            block_hasher=get_request_block_hasher(block, sha256),
        )
        scheduler.add_request(request)
        scheduler.schedule()
        running_before = len(scheduler.running)
        plain = scheduler.reset_prefix_cache()
        forced = scheduler.reset_prefix_cache(reset_running_requests=True)
        print(
            json.dumps(
                {
                    "running_before": running_before,
                    "plain_reset": plain,
                    "forced_reset": forced,
                    "running_after": len(scheduler.running),
                    "waiting_after": len(scheduler.waiting),
                }
            )
        )


if __name__ == "__main__":
    sys.exit(main())
