"""Token-in / token-out generation: the ``Generator`` protocol and its value types.

A generator turns :class:`~gymbridge.trajectory.types.GenerationInput` s (the full
current token sequence with placeholders expanded, plus every media item of the
conversation so far) into :class:`Generation` s. Inputs are built by one function
(``build_generation_input`` / :meth:`gymbridge.generation.chat.ChatCodec.render`),
for every backend.

Invariants of a :class:`Generation`:

* ``len(logprobs) == len(token_ids)``; ``logprobs[i]`` is the log-probability of
  ``token_ids[i]`` under the sampling distribution actually used (temperature and
  top-p applied; greedy decoding reports the raw model distribution);
* ``finish_reason == "stop"`` exactly when the last token is a stop token (it is kept
  in ``token_ids``, as vLLM does, so the next turn's prompt can extend it verbatim);
  otherwise ``"length"``;
* ``prompt_token_ids`` echoes the input's tokens, untouched;
* ``policy_version`` is the generator's ``policy_version`` when the call started (the
  trainer's version of the weights that produced it; ``None`` when unknown). Every
  generator exposes an int ``policy_version`` (0 at start, the initial weights) that a
  weight publisher advances after each optimizer step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeGuard, runtime_checkable

from gymbridge.errors import GymbridgeError
from gymbridge.hf_config import model_sub_configs
from gymbridge.trajectory.types import GenerationInput

__all__ = [
    "GREEDY_BELOW_TEMPERATURE",
    "ContextLengthError",
    "FinishReason",
    "Generation",
    "Generator",
    "RowSeededGenerator",
    "SamplingConfig",
    "is_greedy",
    "media_special_token_ids",
    "model_sub_configs",
    "row_seed",
    "row_seeded",
    "row_seeds",
    "wrapped_policy_version",
]

FinishReason = Literal["stop", "length"]

GREEDY_BELOW_TEMPERATURE = 1e-5
"""A temperature below this (and above 0) samples greedily, as vLLM does (its ``_SAMPLING_EPS``).

Dividing logits by such a temperature is meaningless in the float32 a backend samples in:
1e-40 is a float32 denormal and 1e-300 rounds to 0, so the scaled logits overflow to inf and
the softmax to NaN."""


def is_greedy(temperature: float) -> bool:
    """Whether ``temperature`` (finite, >= 0) means greedy: below :data:`GREEDY_BELOW_TEMPERATURE`."""
    return temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """How to sample one generation. Hashable: requests with equal configs are batched together.

    ``temperature == 0`` means greedy decoding; a temperature in ``(0, GREEDY_BELOW_TEMPERATURE)``
    (1e-5) is stored as 0, so every backend and the trainer see greedy decoding, never logits
    divided into inf / NaN. ``max_tokens`` bounds the generated
    tokens (the backend may lower it to fit the context). ``stop_token_ids`` are
    added to the model's own end-of-sequence ids. ``seed`` makes sampling
    reproducible: row ``j`` of a seeded call samples from its own stream, seeded
    :func:`row_seed` ``(seed, j)``, whatever else shares its batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature != 0.0 and is_greedy(self.temperature):
            object.__setattr__(self, "temperature", 0.0)  # frozen: normalised once, here
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")

    def with_max_tokens(self, max_tokens: int) -> SamplingConfig:
        """A copy with another ``max_tokens``."""
        return SamplingConfig(
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=max_tokens,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
        )


@dataclass(frozen=True, slots=True)
class Generation:
    """One model call's result. See the module docstring for the invariants."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    prompt_token_ids: list[int] = field(default_factory=list)
    policy_version: int | None = None
    """The policy version of the weights that produced this generation (``None``: unknown)."""

    def __post_init__(self) -> None:
        if self.policy_version is not None and self.policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {self.policy_version}")
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"{len(self.token_ids)} generated tokens but {len(self.logprobs)} logprobs: they must agree"
            )


@runtime_checkable
class Generator(Protocol):
    """Token in, token out. Every backend (HF, vLLM, scripted test doubles) implements this.

    ``policy_version`` is the version of the weights the generator now holds (0 at start);
    it stamps every :class:`Generation` it produces.
    """

    policy_version: int

    async def generate(self, inputs: Sequence[GenerationInput], sampling: SamplingConfig) -> list[Generation]:
        """Generate one :class:`Generation` per input, in order."""
        ...


@runtime_checkable
class RowSeededGenerator(Generator, Protocol):
    """A generator that samples every row from a random stream of its own (HF, vLLM).

    ``generate_rows(inputs, sampling, seeds)`` gives row ``j`` what ``generate([inputs[j]],
    replace(sampling, seed=seeds[j]))`` would give alone (``None``: an unseeded row), however
    the rows are batched: so a :class:`~gymbridge.generation.batching.BatchingGenerator` can
    merge seeded requests into one forward pass and each still gets its own answer (the same
    tokens, logprobs equal up to the float summation order of the batch's shapes).
    ``generate(inputs, sampling)`` with a seed is ``generate_rows`` with
    ``[row_seed(seed, j) for j]``.
    """

    async def generate_rows(
        self, inputs: Sequence[GenerationInput], sampling: SamplingConfig, seeds: Sequence[int | None]
    ) -> list[Generation]:
        """One :class:`Generation` per input, in order; row ``j`` sampled under ``seeds[j]``."""
        ...


def row_seeded(generator: Any) -> TypeGuard[RowSeededGenerator]:
    """Whether ``generator`` offers :meth:`RowSeededGenerator.generate_rows` (a callable attribute)."""
    return callable(getattr(generator, "generate_rows", None))


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of row ``row`` of a call seeded ``seed``: ``seed`` itself for row 0 (a
    one-row call samples as seeded), a 63-bit hash of ``(seed, row)`` for the others (rows of
    one call never replay each other's stream)."""
    if row == 0:
        return seed
    digest = hashlib.blake2b(f"gymbridge-row:{seed}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def row_seeds(seed: int | None, rows: int) -> list[int | None]:
    """The row seeds of a call of ``rows`` rows seeded ``seed`` (:func:`row_seed`; ``None``: unseeded)."""
    return [None] * rows if seed is None else [row_seed(seed, j) for j in range(rows)]


def wrapped_policy_version(inner: str) -> Any:
    """A ``policy_version`` property for a wrapper generator: the wrapped one's (``self.<inner>``).

    Read and written through, so a wrapper never holds a stale copy and a publisher that sets
    the wrapper's version sets the wrapped generator's. Typed ``Any`` so that the class
    attribute satisfies :class:`Generator`'s ``policy_version: int``.
    """

    def get(self: Any) -> int:
        return int(getattr(self, inner).policy_version)

    def put(self: Any, version: int) -> None:
        getattr(self, inner).policy_version = version

    return property(get, put, doc="The wrapped generator's policy version (read and written through).")


class ContextLengthError(GymbridgeError):
    """The prompt does not fit the model's context window.

    ``message`` is worded like vLLM's (``"This model's maximum context length is N
    tokens..."``), which is what genuine NeMo Gym ``vllm_model`` recognises.
    """

    def __init__(self, *, prompt_tokens: int, max_model_len: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens} tokens in the messages, Please reduce the length of the messages."
        )


def fit_max_tokens(prompt_len: int, sampling: SamplingConfig, max_model_len: int) -> SamplingConfig:
    """Check a prompt against the context window and lower ``max_tokens`` to what is left.

    Raises :class:`ContextLengthError` when the prompt alone fills the window (vLLM's rule).
    """
    room = max_model_len - prompt_len
    if room <= 0:
        raise ContextLengthError(prompt_tokens=prompt_len, max_model_len=max_model_len)
    return sampling if sampling.max_tokens <= room else sampling.with_max_tokens(room)


def media_special_token_ids(config: Any) -> tuple[int, ...]:
    """Sorted ids a VLM must never *generate*: its media placeholders and vision boundary tokens.

    Read from the model config (``image_token_id``, ``video_token_id``, ``audio_token_id``,
    ``vision_start_token_id``, ``vision_end_token_id``, ``vision_token_id``, Qwen2.5-Omni's
    ``audio_start_token_id`` / ``audio_end_token_id``, the ``*_token_index`` spellings, Gemma-3's
    ``boi`` / ``eoi`` image boundaries; on any of :func:`model_sub_configs`); a text-only LM
    gives ``()``. A sampled audio boundary is as fatal as a sampled placeholder: Qwen2.5-Omni's
    M-RoPE index counts one audio clip per ``audio_start`` token and looks its length up.
    """
    names = (
        "image_token_id",
        "video_token_id",
        "audio_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "vision_token_id",
        "audio_start_token_id",
        "audio_end_token_id",
        "image_token_index",
        "video_token_index",
        "audio_token_index",
        "boi_token_index",
        "eoi_token_index",
    )
    found: set[int] = set()
    for cfg in model_sub_configs(config):
        for name in names:
            value = getattr(cfg, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                found.add(value)
    return tuple(sorted(found))
