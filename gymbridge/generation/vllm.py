"""``VLLMGenerator``: the vLLM backend (GPU; the ``vllm`` extra), token in / token out.

Each :class:`~gymbridge.trajectory.types.GenerationInput` becomes one
``TokensPrompt(prompt_token_ids=..., multi_modal_data=...)`` carrying **all** media of
the conversation so far and a ``SamplingParams`` asking for the sampled token's logprob
only (``logprobs=0``). The engine is vLLM's ``AsyncLLM`` (V1), built from
``AsyncEngineArgs`` with ``logprobs_mode="processed_logprobs"`` so reported logprobs are
those of the distribution sampled from (temperature / top-p applied), like
:class:`~gymbridge.generation.hf.HFGenerator`'s.

**Placeholders once, checked after.** gymbridge's prompts hold every media placeholder
already expanded (``<|image_pad|>`` x N per image), which is what the trajectory records
and the trainer trains on. vLLM's multimodal processor expands placeholders itself, and on
a token prompt it does so again (its prompt-update step reports
``is_update_applied=False`` for token input), so :meth:`VLLMGenerator.build_request`
collapses each run of a modality's placeholder id to one token, the way the model's
processor expects it (one run per media item; any other count is refused). vLLM reports
the prompt it ran (``RequestOutput.prompt_token_ids``, expanded again); it must equal the
recorded prompt token for token, else :class:`VLLMGenerationError` names the first
difference, so a placeholder mismatch can never reach training silently.

Invariants:

* ``vllm`` is imported lazily, on first construction; a missing vLLM raises
  ``ImportError`` naming the extra (``pip install 'gymbridge[vllm]'``);
* :meth:`VLLMGenerator.build_request` is pure (no engine needed) and is what
  :meth:`generate` sends; :func:`generation_from_output` is the one conversion of a
  ``RequestOutput``; both are tested on CPU with a stand-in module;
* media placeholder and vision boundary ids are never sampled: every request carries
  ``SamplingParams.logit_bias = {id: -inf}`` for them (vLLM's documented per-request
  token-id bias, applied as a logits processor *before* temperature / top-p, so with
  ``processed_logprobs`` the reported logprobs are of the masked distribution, exactly
  like :class:`~gymbridge.generation.hf.HFGenerator`'s). ``bad_words`` takes strings
  (re-tokenised, prefix-matched) and ``allowed_token_ids`` would ship the whole
  vocabulary with every request, so neither fits; the ids come from the engine's HF
  config (:func:`~gymbridge.generation.types.media_special_token_ids`) plus
  ``suppress_token_ids``;
* weights are updated through :meth:`update_weights` (``collective_rpc`` into
  :class:`WeightSyncWorkerExtension` on every worker, then a prefix-cache reset so
  no KV computed under the old weights is reused), or broadcast by a trainer through
  :class:`VLLMWeightSink` (the model server's ``/weights/*`` routes): each worker joins the
  trainer's private weight group as rank ``rank_offset + its world rank`` and receives the
  bounded buckets of :mod:`gymbridge.generation.weights`, loading them with the model's own
  ``load_weights`` (which maps Hugging Face names onto vLLM's fused layout). A utility call
  runs between engine steps, so a version is loaded between two steps; a request records the
  version at its submission (its oldest).

**Lowest vLLM: 0.10.2** (the ``vllm`` extra pins it). APIs used: ``vllm.v1.engine.async_llm.AsyncLLM``
(``from_engine_args``, ``generate``, async ``collective_rpc``, ``reset_prefix_cache``),
``AsyncEngineArgs(worker_extension_cls=..., logprobs_mode=...)``, ``TokensPrompt`` with
``multi_modal_data``, ``SamplingParams(logprobs=0, logit_bias=..., detokenize=False)`` and
``vllm.distributed.parallel_state.get_world_group``. ``worker_extension_cls`` and V1
``logit_bias`` are older (0.8.x); ``logprobs_mode`` arrived in 0.10.0 (vLLM PR #21398) but
``processed_logprobs`` only includes temperature and top-p since PR #22387, first in the
0.10.x releases after 0.10.1; 0.10.2 is the first release where downstream RL trainers
(TRL) rely on it, so that is the floor.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from gymbridge.errors import GymbridgeError, WeightSyncError
from gymbridge.generation.types import (
    FinishReason,
    Generation,
    SamplingConfig,
    fit_max_tokens,
    media_special_token_ids,
)
from gymbridge.trajectory.types import GenerationInput

logger = logging.getLogger(__name__)

__all__ = [
    "VLLMGenerationError",
    "VLLMGenerator",
    "VLLMWeightSink",
    "WeightSyncWorkerExtension",
    "collapse_placeholders",
    "generation_from_output",
    "import_vllm",
    "placeholder_token_ids",
]

_EXTENSION_PATH = "gymbridge.generation.vllm.WeightSyncWorkerExtension"


class VLLMGenerationError(GymbridgeError):
    """vLLM returned an output gymbridge cannot use (aborted request, missing logprobs)."""


def import_vllm() -> Any:
    """Import vLLM or raise an ``ImportError`` that names the extra to install."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            "VLLMGenerator needs vLLM, which is not installed: install the extra with "
            "`pip install 'gymbridge[vllm]'` (GPU machines only)"
        ) from exc
    return vllm


class WeightSyncWorkerExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``): loads new weights in place.

    ``self.model_runner`` is the worker's model runner (vLLM sets it up); this
    class adds one method, reached through ``AsyncLLM.collective_rpc``.
    """

    model_runner: Any

    def gymbridge_load_weights(self, named_tensors: list[tuple[str, Any]]) -> int:
        """Load ``(name, tensor)`` pairs with the model's own ``load_weights``; return how many."""
        device = next(self.model_runner.model.parameters()).device
        self.model_runner.model.load_weights(weights=[(n, t.to(device)) for n, t in named_tensors])
        return len(named_tensors)

    def gymbridge_join_weight_group(
        self, host: str, port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> int:
        """Join the trainer's weight group as ``rank_offset`` + this worker's world rank; returns the rank."""
        from gymbridge.generation.weights import open_weight_group, weight_store

        rank = rank_offset + _worker_world_rank()
        store = weight_store(host, port, world_size=world_size, is_host=False, timeout_s=timeout_s)
        self.gymbridge_weight_group = open_weight_group(
            store,
            rank=rank,
            world_size=world_size,
            backend="nccl" if backend == "nccl" else "gloo",
            timeout_s=timeout_s,
        )
        return rank

    def gymbridge_receive_weights(self, buckets: list[dict[str, Any]], timeout_s: float) -> int:
        """Receive one version's buckets (JSON, see ``Bucket``) and load them; returns tensors loaded."""
        import torch

        from gymbridge.generation.weights import Bucket, dtype_from_name, unbucket

        group = getattr(self, "gymbridge_weight_group", None)
        if group is None:
            raise WeightSyncError("this worker has not joined a weight group")
        device = next(self.model_runner.model.parameters()).device
        loaded = 0
        for raw in buckets:
            bucket = Bucket.from_json(raw)
            flat = torch.empty(bucket.numel, dtype=dtype_from_name(bucket.dtype), device=device)
            group.broadcast(flat, timeout_s=timeout_s)
            self.model_runner.model.load_weights(
                weights=[(s.name, view) for s, view in unbucket(bucket, flat)]
            )
            loaded += len(bucket.specs)
            del flat
        return loaded


def _worker_world_rank() -> int:
    from vllm.distributed.parallel_state import get_world_group

    return int(get_world_group().rank)


def placeholder_token_ids(hf_config: Any) -> dict[str, int]:
    """Modality -> the placeholder id its processor expands (``image_token_id`` / ``*_token_index``)."""
    out: dict[str, int] = {}
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        if cfg is None:
            continue
        for modality in ("image", "video", "audio"):
            for attr in (f"{modality}_token_id", f"{modality}_token_index"):
                value = getattr(cfg, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    out.setdefault(modality, value)
    return out


def collapse_placeholders(
    prompt_token_ids: Sequence[int], media_counts: dict[str, int], placeholders: dict[str, int]
) -> list[int]:
    """``prompt_token_ids`` with each run of a modality's placeholder id collapsed to one token.

    Only modalities with media are collapsed; each must have exactly one run per media item
    (else :class:`VLLMGenerationError`: the prompt and its media disagree).
    """
    collapse = {placeholders[m]: m for m, n in media_counts.items() if n and m in placeholders}
    if not collapse:
        return list(prompt_token_ids)
    out: list[int] = []
    runs: dict[str, int] = dict.fromkeys(collapse.values(), 0)
    previous: int | None = None
    for token in prompt_token_ids:
        if token in collapse and token == previous:
            continue
        if token in collapse:
            runs[collapse[token]] += 1
        out.append(token)
        previous = token
    for modality, count in runs.items():
        if count != media_counts[modality]:
            raise VLLMGenerationError(
                f"the prompt holds {count} run(s) of {modality} placeholders for "
                f"{media_counts[modality]} {modality} item(s): each item needs exactly one run"
            )
    return out


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def generation_from_output(
    output: Any, policy_version: int | None = None, expected_prompt: Sequence[int] | None = None
) -> Generation:
    """A vLLM ``RequestOutput`` (one completion, ``logprobs=0``) -> :class:`Generation`.

    With ``expected_prompt`` (the prompt the trajectory records), vLLM's reported prompt ids
    must equal it (else :class:`VLLMGenerationError` naming the first difference), and the
    generation's ``prompt_token_ids`` is that recorded prompt.
    """
    if not output.outputs:
        raise VLLMGenerationError(f"request {output.request_id}: vLLM returned no completion")
    completion = output.outputs[0]
    token_ids = [int(t) for t in completion.token_ids]
    if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
        raise VLLMGenerationError(
            f"request {output.request_id}: vLLM returned {len(token_ids)} tokens but "
            f"{0 if completion.logprobs is None else len(completion.logprobs)} logprob entries"
        )
    logprobs: list[float] = []
    for pos, (tok, entry) in enumerate(zip(token_ids, completion.logprobs, strict=True)):
        lp = entry.get(tok) if hasattr(entry, "get") else None
        if lp is None:
            raise VLLMGenerationError(f"request {output.request_id}: no logprob for sampled token {pos}")
        logprobs.append(float(getattr(lp, "logprob", lp)))
    reason = completion.finish_reason
    if reason not in ("stop", "length"):
        raise VLLMGenerationError(f"request {output.request_id}: finished with {reason!r}")
    finish: FinishReason = "stop" if reason == "stop" else "length"
    reported = [int(t) for t in output.prompt_token_ids or []]
    if expected_prompt is not None:
        expected = list(expected_prompt)
        if reported != expected:
            at = _first_difference(reported, expected)
            raise VLLMGenerationError(
                f"request {output.request_id}: vLLM ran a prompt of {len(reported)} tokens but the "
                f"trajectory records {len(expected)}; first difference at position {at} "
                f"(vLLM {reported[at : at + 3]}, recorded {expected[at : at + 3]}): the media "
                "placeholders were expanded differently"
            )
        reported = expected
    return Generation(token_ids, logprobs, finish, reported, policy_version)


class VLLMGenerator:
    """Generate with vLLM's ``AsyncLLM``; see the module docstring.

    Pass ``engine`` to wrap an engine built elsewhere (it needs ``generate``,
    ``collective_rpc`` and ``reset_prefix_cache``); otherwise one is built from
    ``model`` and ``engine_args`` (``AsyncEngineArgs`` keywords). ``codec`` (the
    :class:`ChatCodec` the model server and native rollouts need) is built from
    ``processor``, else from the processor saved with ``model`` unless
    ``load_processor=False``.
    """

    continuous_batching = True
    """vLLM batches concurrent requests itself: no :class:`BatchingGenerator` in front of it."""

    def __init__(
        self,
        model: str,
        *,
        engine_args: dict[str, Any] | None = None,
        engine: Any | None = None,
        max_model_len: int | None = None,
        processor: Any | None = None,
        load_processor: bool = True,
        reasoning_parser: bool = True,
        suppress_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.model_name = model
        self._vllm = import_vllm()
        args: dict[str, Any] = {
            "model": model,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": _EXTENSION_PATH,
        }
        args.update(engine_args or {})
        if max_model_len is not None:
            args["max_model_len"] = max_model_len
        if engine is None:
            from vllm.v1.engine.async_llm import AsyncLLM

            engine = AsyncLLM.from_engine_args(self._vllm.AsyncEngineArgs(**args))
        self.engine = engine
        self.max_model_len: int = int(
            max_model_len or getattr(getattr(engine, "model_config", None), "max_model_len", 0) or 32768
        )
        self._ids = itertools.count()
        self.policy_version: int = 0
        """Version of the weights the engine now holds (0: the initial weights)."""
        hf_config = getattr(getattr(engine, "model_config", None), "hf_config", None)
        found = media_special_token_ids(hf_config) if hf_config is not None else ()
        self.suppressed_token_ids: tuple[int, ...] = tuple(sorted(set(found) | set(suppress_token_ids or ())))
        """Ids never sampled (``logit_bias`` -inf); the trainer must renormalise without them."""
        self.placeholder_token_ids: dict[str, int] = (
            placeholder_token_ids(hf_config) if hf_config is not None else {}
        )
        """Modality -> the placeholder id vLLM's processor expands (collapsed to one per item here)."""
        self.codec: Any = None
        if processor is None and load_processor:
            try:
                import transformers

                processor = transformers.AutoProcessor.from_pretrained(model)  # type: ignore[no-untyped-call]
            except (OSError, ValueError):
                processor = None
        if processor is not None:
            from gymbridge.generation.chat import ChatCodec

            self.codec = ChatCodec(processor, reasoning_parser=reasoning_parser)

    def build_request(self, inp: GenerationInput, sampling: SamplingConfig) -> tuple[Any, Any]:
        """The ``(TokensPrompt, SamplingParams)`` pair sent for one input (pure; no engine)."""
        from vllm.inputs import TokensPrompt

        counts = {m: len(v) for m, v in inp.multi_modal_data.items()}
        ids = collapse_placeholders(inp.prompt_token_ids, counts, self.placeholder_token_ids)
        prompt: Any = TokensPrompt(prompt_token_ids=ids)
        if inp.multi_modal_data:
            prompt["multi_modal_data"] = {k: list(v) for k, v in inp.multi_modal_data.items()}
        params = self._vllm.SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=sampling.seed,
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
            logit_bias={t: float("-inf") for t in self.suppressed_token_ids} or None,
        )
        return prompt, params

    async def _one(self, inp: GenerationInput, sampling: SamplingConfig) -> Generation:
        prompt, params = self.build_request(inp, sampling)
        request_id = f"gymbridge-{next(self._ids)}"
        # the version at submission: updates are applied between engine steps, so a request
        # never straddles one unless a publisher runs while it is in flight (then this is its oldest)
        version = self.policy_version
        final: Any = None
        async for out in self.engine.generate(prompt, params, request_id):
            final = out
        if final is None or not getattr(final, "finished", True):
            raise VLLMGenerationError(f"request {request_id}: the engine stream ended without a final output")
        return generation_from_output(final, version, inp.prompt_token_ids)

    async def generate(self, inputs: Sequence[GenerationInput], sampling: SamplingConfig) -> list[Generation]:
        # each row's max_tokens is fitted to its own room (checked for all rows before any request)
        fitted = [fit_max_tokens(len(i.prompt_token_ids), sampling, self.max_model_len) for i in inputs]
        # vLLM batches concurrent requests itself (continuous batching).
        return list(await asyncio.gather(*(self._one(i, s) for i, s in zip(inputs, fitted, strict=True))))

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> int:
        """Load new policy weights into every worker, then drop the prefix cache. Returns tensors loaded."""
        tensors = [(name, t.detach().cpu()) for name, t in named_tensors]
        counts = await self.engine.collective_rpc("gymbridge_load_weights", args=(tensors,))
        await self.engine.reset_prefix_cache()
        logger.info("loaded %d tensors into %d vLLM worker(s)", len(tensors), len(counts or []))
        return len(tensors)


class VLLMWeightSink:
    """The model server's :class:`~gymbridge.generation.weights.WeightSink` for a :class:`VLLMGenerator`.

    Every vLLM worker is a member of the trainer's weight group (``ranks`` = the engine's
    parallel world size); the server's own process joins only the group's store, to mark each
    version loaded. Layout names are Hugging Face names that each worker's ``load_weights``
    maps (vLLM fuses q/k/v and gate/up), so here they are checked for duplicates only; a name
    the model does not know fails inside ``load_weights`` and the version is marked failed.
    """

    def __init__(self, generator: VLLMGenerator) -> None:
        self.generator = generator
        config = getattr(getattr(generator.engine, "vllm_config", None), "parallel_config", None)
        self.ranks = int(getattr(config, "world_size", 1) or 1)
        self._store: Any = None

    @property
    def policy_version(self) -> int:
        return self.generator.policy_version

    def check(self, specs: Sequence[Any]) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise WeightSyncError("the weight layout names a tensor twice")

    async def join(
        self, *, host: str, port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        from gymbridge.generation.weights import weight_store

        self._store = await asyncio.to_thread(
            weight_store, host, port, world_size=world_size, is_host=False, timeout_s=timeout_s
        )
        await self.generator.engine.collective_rpc(
            "gymbridge_join_weight_group", args=(host, port, rank_offset, world_size, backend, timeout_s)
        )

    async def receive(self, version: int, buckets: Sequence[Any], *, timeout_s: float) -> float:
        import time

        started = time.perf_counter()
        await self.generator.engine.collective_rpc(
            "gymbridge_receive_weights", args=([b.to_json() for b in buckets], timeout_s)
        )
        await self.generator.engine.reset_prefix_cache()  # no KV of the old weights is reused
        self.generator.policy_version = version
        return time.perf_counter() - started

    def mark_loaded(self, version: int, outcome: str) -> None:
        from gymbridge.generation.weights import loaded_key

        if self._store is not None:
            self._store.set(loaded_key(version), outcome)

    def close(self) -> None:
        self._store = None
