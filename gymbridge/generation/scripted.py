"""``ScriptedGenerator``: force chosen model calls to chosen tokens, sample the rest.

A random-weight model almost never emits a well-formed tool call, yet tests and
demos need episodes that call tools (a tool image arriving at turn 2). This
wrapper consumes a script, one entry per model call in call order: an entry of
token ids forces that call's output (its logprobs are the inner generator's
teacher-forced logprobs under the same temperature, with top-p off since a
forced token may lie outside the nucleus); ``None`` lets the
inner generator sample. After the script runs out every call samples.

Invariant: the forced calls see exactly the inputs a sampled call would; only
the choice of tokens differs. Use with one episode at a time (the script is a
single global sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gymbridge.generation.types import Generation, SamplingConfig, wrapped_policy_version
from gymbridge.trajectory.types import GenerationInput

__all__ = ["ScoringGenerator", "ScriptedGenerator"]


class ScoringGenerator(Protocol):
    policy_version: int

    async def generate(
        self, inputs: Sequence[GenerationInput], sampling: SamplingConfig
    ) -> list[Generation]: ...

    async def score(
        self,
        inputs: Sequence[GenerationInput],
        continuations: Sequence[Sequence[int]],
        sampling: SamplingConfig,
    ) -> list[Generation]: ...


class ScriptedGenerator:
    """Wrap ``inner`` (which can ``score``); see the module docstring. ``inputs_seen`` records every input."""

    def __init__(self, inner: ScoringGenerator, script: Sequence[Sequence[int] | None]) -> None:
        self.inner = inner
        self._script = [None if s is None else list(s) for s in script]
        self.inputs_seen: list[GenerationInput] = []
        self.outputs: list[Generation] = []
        for attr in ("codec", "max_model_len", "model_name"):
            if hasattr(inner, attr):
                setattr(self, attr, getattr(inner, attr))

    policy_version = wrapped_policy_version("inner")

    async def generate(self, inputs: Sequence[GenerationInput], sampling: SamplingConfig) -> list[Generation]:
        out: list[Generation] = []
        for inp in inputs:
            self.inputs_seen.append(inp)
            forced = self._script.pop(0) if self._script else None
            if forced is None:
                out.extend(await self.inner.generate([inp], sampling))
            else:
                # top-p off: a forced token may lie outside the nucleus (logprob -inf)
                unclipped = SamplingConfig(
                    temperature=sampling.temperature,
                    max_tokens=sampling.max_tokens,
                    stop_token_ids=sampling.stop_token_ids,
                    seed=sampling.seed,
                )
                out.extend(await self.inner.score([inp], [forced], unclipped))
        self.outputs.extend(out)
        return out
