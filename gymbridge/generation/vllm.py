"""``VLLMGenerator``: the vLLM backend (GPU; the ``vllm`` extra), token in / token out.

Each :class:`~gymbridge.trajectory.types.GenerationInput` becomes one
``TokensPrompt(prompt_token_ids=..., multi_modal_data=...)`` carrying **all** media of
the conversation so far (vLLM accepts prompts whose placeholders are already
expanded: it detects the applied replacements) and a ``SamplingParams`` asking for
the sampled token's logprob only (``logprobs=0``). The engine is vLLM's ``AsyncLLM``
(V1), built from ``AsyncEngineArgs`` with ``logprobs_mode="processed_logprobs"`` so
reported logprobs are those of the distribution sampled from (temperature / top-p
applied), like :class:`~gymbridge.generation.hf.HFGenerator`'s.

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
  no KV computed under the old weights is reused).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from gymbridge.errors import GymbridgeError
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
    "WeightSyncWorkerExtension",
    "generation_from_output",
    "import_vllm",
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


def generation_from_output(output: Any, policy_version: int | None = None) -> Generation:
    """A vLLM ``RequestOutput`` (one completion, ``logprobs=0``) -> :class:`Generation`."""
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
    return Generation(
        token_ids, logprobs, finish, [int(t) for t in output.prompt_token_ids or []], policy_version
    )


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

        prompt: Any = TokensPrompt(prompt_token_ids=list(inp.prompt_token_ids))
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
        return generation_from_output(final, version)

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
