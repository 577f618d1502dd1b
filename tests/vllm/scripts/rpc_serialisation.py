"""Run in .venv-vllm: ``update_weights``' ``collective_rpc`` arguments through vLLM's own msgpack round trip.

An ``AsyncLLM`` client encodes a utility call with ``MsgpackEncoder`` as
``(client_index, call_id, "collective_rpc", (method, timeout, args, kwargs))``; the engine core
decodes it with a ``MsgpackDecoder`` that has no type to decode into, converts the arguments with
``EngineCoreProc._convert_msgspec_args`` and calls the executor, which calls the worker's method.
This replays that path with vLLM's classes: the calls ``VLLMGenerator.update_weights`` makes (captured
from a recording engine) are encoded and decoded, then run on the worker extension, and the
model ends up with the sent values. It also records what a tensor argument becomes (the bug).
"""

from __future__ import annotations

import asyncio
import json
import types
from typing import Any

import torch
from vllm.v1.engine.core import EngineCore, EngineCoreProc
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from gymbridge.generation import vllm as backend


class Recorder:
    """Records the ``collective_rpc`` calls; the rest of ``AsyncLLM``'s surface succeeds."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,  # noqa: ASYNC109 - AsyncLLM's signature
        args: tuple[Any, ...] = (),
        kwargs: Any = None,
    ) -> list[Any]:
        self.calls.append((method, args))
        return [None]

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return True

    async def reset_encoder_cache(self) -> None:
        return None


def through_vllm(method: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` as the engine core hands them on: vLLM's encode, decode and argument conversion."""
    frames = MsgpackEncoder().encode((0, 1, "collective_rpc", (method, None, args, None)))
    _, _, utility, decoded = MsgpackDecoder().decode(frames)
    assert utility == "collective_rpc"
    method_out, _timeout, rpc_args, _kwargs = EngineCoreProc._convert_msgspec_args(
        EngineCore.collective_rpc, decoded
    )
    assert method_out == method
    return tuple(rpc_args)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 4)
        self.b = torch.nn.Linear(4, 2, bias=False).to(torch.bfloat16)

    def load_weights(self, weights: Any) -> set[str]:
        own = dict(self.named_parameters())
        done = set()
        with torch.no_grad():
            for name, tensor in weights:
                own[name].copy_(tensor)
                done.add(name)
        return done


source = Model()
torch.manual_seed(0)
for p in source.parameters():
    torch.nn.init.normal_(p)
engine = Recorder()
gen = backend.VLLMGenerator("unused", engine=engine, load_processor=False)
asyncio.run(gen.update_weights(source.named_parameters(), version=1, bucket_bytes=32))

target = Model()
ext = backend.WeightSyncWorkerExtension()
ext.model_runner = types.SimpleNamespace(model=target)
loaded = 0
for method, args in engine.calls:
    loaded += getattr(ext, method)(*through_vllm(method, args))
same = all(torch.equal(a, b) for a, b in zip(source.parameters(), target.parameters(), strict=True))

# the bug: a tensor argument does not arrive as a tensor
(tensor_arg,) = through_vllm("gymbridge_load_weights", ([("w", torch.ones(2, 2))],))
arrived = tensor_arg[0][1]

print(
    json.dumps(
        {
            "rpc_calls": len(engine.calls),
            "methods": sorted({m for m, _ in engine.calls}),
            "tensors_loaded": loaded,
            "tensors_sent": len(list(source.parameters())),
            "values_equal": same,
            "tensor_arrives_as": type(arrived).__name__,
        }
    )
)
