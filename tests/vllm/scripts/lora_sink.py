"""Run in .venv-vllm: ``VLLMWeightSink`` takes a LoRA trainer's publications through vLLM's LoRA path.

The test (tests/vllm/test_lora_vllm.py) writes, from the tiny Qwen2-VL with LoRA applied in gymbridge's
venv (``vision: full``): ``model/`` (its config), ``settings.json`` (``lora_settings``),
``v0.safetensors`` (the adapters at their initial values: a publication of adapters only) and
``v1.safetensors`` (drawn adapters plus the vision encoder's full tensors), under the trainer's
in-model names.

The engine here is a stand-in for ``AsyncLLM`` with one worker, built of real vLLM parts:
``collective_rpc`` calls gymbridge's ``WeightSyncWorkerExtension`` over vLLM's model class built on
the CPU and LoRA-wrapped by the worker's own ``LRUCacheWorkerLoRAManager``; its weight group hands
each broadcast the trainer's bucket; ``add_lora`` / ``remove_lora`` are that manager's
``add_adapter`` / ``remove_adapter`` (what the executor's ``collective_rpc("add_lora")`` reaches on a
worker); ``generate`` records the ``lora_request`` it is given and can hold a request in flight.
``VLLMGenerator`` builds real ``TokensPrompt`` / ``SamplingParams`` / ``LoRARequest``. Also checked
with vLLM's own request block hasher: the KV block keys of one prompt differ between two adapters
(why an adapter-only version resets no cache).

Prints one JSON object of observations (see ``main``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch
from lora_loader import cpu_lora_platform, lora_model
from weight_names import borrow_cpu_attention_selector, init_distributed


class BucketGroup:
    """A weight group whose broadcasts receive the trainer's buckets, in order."""

    def __init__(self) -> None:
        self.pending: list[torch.Tensor] = []

    def broadcast(self, flat: torch.Tensor, timeout_s: float | None = None) -> None:
        flat.copy_(self.pending.pop(0))


class Engine:
    """``AsyncLLM``'s surface as ``VLLMGenerator`` uses it, over one CPU worker of real vLLM parts."""

    def __init__(self, model: Any, manager: Any, vllm_config: Any) -> None:
        from gymbridge.generation.vllm import WeightSyncWorkerExtension

        self.vllm_config = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(world_size=1), lora_config=vllm_config.lora_config
        )
        self.manager = manager
        self.worker = WeightSyncWorkerExtension()
        self.worker.model_runner = types.SimpleNamespace(model=model)
        self.group = BucketGroup()
        self.worker.gymbridge_weight_group = self.group  # type: ignore[attr-defined]
        self.requests: list[tuple[str, Any]] = []
        self.calls: list[str] = []
        self.cache_resets = 0
        self.gate = asyncio.Event()
        self.holding = asyncio.Event()
        self.hold_next = False
        """The next request sets ``holding`` and waits for ``gate`` (in flight across a swap)."""

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append(method)
        return [getattr(self.worker, method)(*args)]

    async def add_lora(self, lora_request: Any) -> bool:
        self.calls.append(f"add_lora {lora_request.lora_int_id}")
        return bool(self.manager.add_adapter(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        self.calls.append(f"remove_lora {lora_id}")
        return bool(self.manager.remove_adapter(lora_id))

    async def generate(self, prompt: Any, params: Any, request_id: str, *, lora_request: Any = None) -> Any:
        self.requests.append((request_id, lora_request))
        if self.hold_next:
            self.hold_next = False
            self.holding.set()
            await self.gate.wait()
        logprobs = [{7: types.SimpleNamespace(logprob=-0.5)}]
        yield types.SimpleNamespace(
            request_id=request_id,
            prompt_token_ids=list(prompt["prompt_token_ids"]),
            outputs=[types.SimpleNamespace(token_ids=[7], logprobs=logprobs, finish_reason="stop")],
            finished=True,
        )

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append("pause")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.cache_resets += 1
        return True

    async def reset_encoder_cache(self) -> None:
        pass


def buckets_of(engine: Engine, tensors: dict[str, torch.Tensor]) -> list[Any]:
    """The trainer's buckets of ``tensors``; their flat buffers wait in the engine's weight group."""
    from gymbridge.generation.weights import bucket_tensors, plan_buckets

    named = list(tensors.items())
    buckets = plan_buckets(named, 64 * 1024)
    engine.group.pending = [
        bucket_tensors(b, [tensors[s.name] for s in b.specs], torch.device("cpu")) for b in buckets
    ]
    return buckets


def listing(path: str) -> list[str]:
    return sorted(p.name for p in Path(path).iterdir())


def is_dir(path: str) -> bool:
    return Path(path).is_dir()


def refusal(action: Any) -> str:
    from gymbridge.errors import WeightSyncError

    try:
        action()
    except WeightSyncError as exc:
        return str(exc)
    return "accepted"


def kv_keys_differ_between_adapters(path: str) -> bool:
    """vLLM's request block hasher gives one prompt other block keys under another adapter."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    keys = []
    for lora_id in (1, 2):
        request = Request(
            request_id=f"r{lora_id}",
            prompt_token_ids=list(range(1, 41)),
            sampling_params=SamplingParams(max_tokens=8),
            pooling_params=None,
            lora_request=LoRARequest(lora_name=f"gymbridge-{lora_id}", lora_int_id=lora_id, lora_path=path),
            block_hasher=get_request_block_hasher(16, sha256),
        )
        keys.append(list(request.block_hashes))
    return len(keys[0]) == 2 and not set(keys[0]) & set(keys[1])


async def scenario(root: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    from gymbridge.generation.types import SamplingConfig
    from gymbridge.generation.vllm import VLLMGenerator, VLLMWeightSink
    from gymbridge.generation.weights import TensorSpec
    from gymbridge.trajectory.types import GenerationInput

    settings = json.loads((root / "settings.json").read_text())
    v0 = load_file(str(root / "v0.safetensors"))
    v1 = load_file(str(root / "v1.safetensors"))
    model, manager, vllm_config = lora_model(str(root / "model"))
    engine = Engine(model, manager, vllm_config)
    generator = VLLMGenerator("tiny-qwen2-vl", engine=engine, max_model_len=512, load_processor=False)
    sink = VLLMWeightSink(generator)
    inp = GenerationInput(prompt_token_ids=[1, 2, 3])
    sampling = SamplingConfig(max_tokens=1)
    out: dict[str, Any] = {}

    # refusals: an engine without LoRA, a rank above max_lora_rank, full tensors with vision frozen
    plain = VLLMGenerator("tiny", engine=types.SimpleNamespace(generate=None), load_processor=False)
    out["refused_without_lora"] = refusal(lambda: VLLMWeightSink(plain).prepare_lora(settings))
    out["refused_rank"] = refusal(lambda: sink.prepare_lora({**settings, "r": 32}))
    sink.prepare_lora({**settings, "vision": "frozen"})
    specs1 = [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in v1.items()]
    out["refused_frozen_full"] = refusal(lambda: sink.check(specs1))

    sink.prepare_lora(settings)
    sink.check(specs1)
    (before,) = await generator.generate([inp], sampling)
    out["base_request"] = engine.requests[-1][1] is None and before.policy_version == 0

    # version 0: adapters only (their initial values)
    await sink.receive(0, buckets_of(engine, v0), timeout_s=5)
    adapter0 = generator.lora_request
    out["v0"] = {
        "lora_request": [adapter0.lora_name, adapter0.lora_int_id],
        "files": listing(adapter0.lora_path),
        "registered": sorted(manager.list_adapters()),
        "cache_resets": engine.cache_resets,
    }
    (gen0,) = await generator.generate([inp], sampling)
    out["v0"]["request_carries"] = engine.requests[-1][1].lora_int_id
    out["v0"]["policy_version"] = gen0.policy_version

    # a request in flight across version 1 keeps adapter 0; version 1 brings adapters + encoder
    engine.hold_next = True
    in_flight = asyncio.ensure_future(generator.generate([inp], sampling))
    await engine.holding.wait()
    held_carries = engine.requests[-1][1].lora_int_id
    await sink.receive(1, buckets_of(engine, v1), timeout_s=5)
    adapter1 = generator.lora_request
    (gen1,) = await generator.generate([inp], sampling)
    params = dict(model.named_parameters())
    encoder = "visual.blocks.0.attn.proj.weight"
    out["v1"] = {
        "lora_request": [adapter1.lora_name, adapter1.lora_int_id],
        "request_carries": engine.requests[-1][1].lora_int_id,
        "policy_version": gen1.policy_version,
        "cache_resets": engine.cache_resets,
        "registered_while_old_in_flight": sorted(manager.list_adapters()),
        "old_dir_while_in_flight": is_dir(adapter0.lora_path),
        "encoder_loaded": bool(torch.equal(params[encoder], v1[f"model.{encoder}"])),
    }
    loaded = manager._adapter_manager.get_adapter(adapter1.lora_int_id)
    o_proj = "language_model.model.layers.0.self_attn.o_proj"
    sent = "model.language_model.layers.0.self_attn.o_proj.lora_{}.default.weight"
    held_o = loaded.loras[o_proj]  # vLLM folds the alpha / r scale into lora_b (optimize())
    scale = settings["lora_alpha"] / settings["r"]
    out["v1"]["adapter_values_equal"] = bool(
        torch.equal(held_o.lora_a, v1[sent.format("A")])
        and torch.allclose(held_o.scaling * held_o.lora_b, scale * v1[sent.format("B")])
    )
    engine.gate.set()
    (held,) = await in_flight
    out["in_flight"] = {
        "carried": held_carries,
        "policy_version": held.policy_version,
        "registered_after": sorted(manager.list_adapters()),
        "old_dir_after": is_dir(adapter0.lora_path),
        "removed": [c for c in engine.calls if c.startswith("remove_lora")],
    }

    # a publication vLLM's loader refuses (an adapter of the wrong width) leaves version 1 serving
    broken = dict(v1)
    name = "model.language_model.layers.0.self_attn.o_proj.lora_A.default.weight"
    broken[name] = torch.zeros(broken[name].shape[0], broken[name].shape[1] + 3)
    try:
        await sink.receive(2, buckets_of(engine, broken), timeout_s=5)
        out["broken"] = {"error": None}
    except Exception as exc:
        out["broken"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    out["broken"].update(
        serving=generator.lora_request.lora_int_id,
        policy_version=generator.policy_version,
        registered=sorted(manager.list_adapters()),
        dirs=listing(str(Path(adapter1.lora_path).parent)),
    )

    # the in-band path (update_weights: buckets through collective_rpc) takes the same publication
    loaded_count = await generator.update_weights(v1.items(), version=3)
    (gen3,) = await generator.generate([inp], sampling)
    out["in_band"] = {
        "loaded": loaded_count,
        "serving": generator.lora_request.lora_int_id,
        "request_carries": engine.requests[-1][1].lora_int_id,
        "policy_version": gen3.policy_version,
        "registered": sorted(manager.list_adapters()),
    }
    out["kv_keys_differ"] = kv_keys_differ_between_adapters(adapter1.lora_path)
    return out


def main() -> None:
    init_distributed()
    borrow_cpu_attention_selector()
    cpu_lora_platform()
    print(json.dumps(asyncio.run(scenario(Path(sys.argv[1])))))


if __name__ == "__main__":
    sys.exit(main())
