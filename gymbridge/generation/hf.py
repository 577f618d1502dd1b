"""``HFGenerator``: the transformers backend (CPU here, GPU elsewhere), token in / token out.

Takes :class:`~gymbridge.trajectory.types.GenerationInput` s whose prompts already hold expanded
media placeholders; the media (all of the conversation so far, in order) go through the model's
sub-processors with the function the trainer's batches use
(:func:`~gymbridge.tensors.processor.process_decoded`) and reach the model under the names its
``forward`` takes. Works with the tiny offline Qwen2-VL (:meth:`HFGenerator.tiny`), the tiny
Qwen2.5-Omni thinker (:meth:`HFGenerator.tiny_omni`) and any local Hugging Face VLM or causal LM
(:meth:`HFGenerator.from_pretrained`).

Invariants:

* requests are batched (left padding, up to ``max_batch_size`` rows); ``max_tokens`` is lowered
  per row to what that row's context leaves; one ``generate`` runs at a time, off the event loop;
* ``logprobs`` are of the distribution sampled from (after temperature and top-p; raw logits when
  greedy), reproducible by a teacher-forced forward pass;
* a row whose placeholder count disagrees with its media is refused (``ProtocolError``) before
  any model work;
* every row samples from a torch generator of its own (:class:`_RowSampler`; row ``j`` of a call
  seeded ``s`` from ``row_seed(s, j)``, an unseeded row from fresh entropy): the global torch RNG
  is untouched, seeded rows are reproducible whatever shares their batch, so seeded requests are
  batched too (:meth:`HFGenerator.generate_rows`), and unseeded rows never repeat one another;
* media placeholder and vision boundary tokens are never sampled (logits ``-inf`` before
  temperature / top-p); :meth:`score_sync` / :meth:`processed_logprobs` apply the same mask, as the
  trainer does (docs/generation.md, "Media tokens are never sampled");
* a generate or scoring call is one use of the generator's :class:`~gymbridge.generation.weights.WeightGate`
  (:attr:`HFGenerator.weights_lock`): a publication staged meanwhile is swapped in as the call
  ends, and calls starting while it is pending wait for it, so every token of a generation comes
  from the weights of the ``policy_version`` it reports (read during the call);
* :meth:`HFGenerator.from_pretrained` loads safetensors weights only: a directory with only
  pickle weights (``pytorch_model.bin``) is refused before anything is read
  (:func:`check_safetensors_weights`), since unpickling runs code from the file.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gymbridge.errors import ConfigError, ProtocolError
from gymbridge.generation.chat import ChatCodec
from gymbridge.generation.types import (
    FinishReason,
    Generation,
    SamplingConfig,
    fit_max_tokens,
    media_special_token_ids,
    row_seeds,
)
from gymbridge.generation.weights import WeightGate
from gymbridge.trajectory.types import GenerationInput

if TYPE_CHECKING:
    from gymbridge.media.cache import MediaCache

logger = logging.getLogger(__name__)

__all__ = ["HFGenerator", "check_safetensors_weights", "image_placeholder_token", "suppress_logits"]


_PLURAL = {"image": "images", "video": "videos", "audio": "audio clips"}


def _constant(value: Any) -> Callable[[], Any]:
    return lambda: value


def image_placeholder_token(path: str, tokenizer: Any) -> str | None:
    """The token a model's prompts spell an image placeholder with, or ``None`` if it has none.

    Read from the saved config's image placeholder id (``image_token_id`` /
    ``image_token_index``, on the config, its ``text_config`` or a Qwen2.5-Omni
    ``thinker_config``) through ``tokenizer``: Qwen2-VL's ``<|image_pad|>``, Qwen2.5-Omni's
    ``<|IMAGE|>``. Without a config, ``<|image_pad|>`` when the vocabulary has it.
    """
    import transformers

    from gymbridge.hf_config import model_sub_configs

    vocab = tokenizer.get_vocab()
    try:
        config: Any = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError):
        config = None
    for cfg in model_sub_configs(config) if config is not None else []:
        for attr in ("image_token_id", "image_token_index"):
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                token = tokenizer.convert_ids_to_tokens(value)
                if isinstance(token, str) and vocab.get(token) == value:
                    return token
    return "<|image_pad|>" if "<|image_pad|>" in vocab else None


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_safetensors_weights(path: str | Path) -> None:
    """Refuse a model directory whose weights are pickles only (:class:`ConfigError` naming them).

    ``from_pretrained`` unpickles ``pytorch_model.bin`` when no ``*.safetensors`` is there, and
    unpickling runs whatever code the file holds. A directory with safetensors weights (or none
    of either: transformers' own error then says what is missing) passes.
    """
    folder = Path(path)
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return
    pickled = sorted(f.name for f in folder.iterdir() if f.is_file() and f.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise ConfigError(
            [
                f"model {path}: its weights are pickle files only ({', '.join(pickled)}) and no "
                "*.safetensors; gymbridge never unpickles (loading a pickle runs code from the file). "
                "Convert them once where you trust the file: "
                "AutoModel.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
            ],
            source=str(path),
        )


def suppress_logits(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """A copy of ``[..., V]`` ``logits`` with ``token_ids`` set to ``-inf`` (ids >= V are ignored)."""
    ids = [t for t in token_ids if 0 <= t < logits.shape[-1]]
    if not ids:
        return logits
    out = logits.clone()
    out[..., ids] = float("-inf")
    return out


def _tokenizer_processor(path: str) -> Any:
    """A saved tokenizer; for a Qwen-VL-style model (Qwen-VL, the Qwen2.5-Omni thinker, or one of no
    registered family) with a saved image processor but no processor class, that image processor with
    Qwen-VL placeholder expansion of the model's own image placeholder
    (:func:`image_placeholder_token`; :class:`~gymbridge.models.tiny_vlm.TinyVLMProcessor`)."""
    import transformers

    from gymbridge.families import GENERIC, QwenVL, family_of

    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    try:
        config: Any = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError):
        config = None
    family = family_of(config) if config is not None else GENERIC
    if family is not GENERIC and not isinstance(family, QwenVL):
        return tokenizer  # another family's expansion is not Qwen-VL's
    image_token = image_placeholder_token(path, tokenizer)
    if image_token is None:
        return tokenizer
    # Any: transformers types from_pretrained in some releases and not in others (mypy --strict on both)
    auto_image_processor: Any = transformers.AutoImageProcessor
    try:
        image_processor = auto_image_processor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, ImportError):
        return tokenizer
    from gymbridge.models.tiny_vlm import TinyVLMProcessor

    return TinyVLMProcessor(tokenizer, image_processor, image_token=image_token)


def _warped_logprobs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log-probabilities of float ``logits`` after ``sampling``'s temperature and top-p (raw when
    greedy): what the generator samples from and the trainer's teacher forcing reproduces."""
    if sampling.temperature == 0.0:
        return torch.log_softmax(logits, dim=-1)
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(sampling.temperature)(None, logits)
    if sampling.top_p < 1.0:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    return torch.log_softmax(scores, dim=-1)


class _RowSampler:
    """A logits processor that samples each row from its own RNG stream (Gumbel-max).

    Given the scores of one step (media ids already masked), it applies temperature and top-p
    (:func:`_warped_logprobs`, as :meth:`HFGenerator.processed_logprobs` does), draws row
    ``r``'s token as the argmax of ``logp + Gumbel noise`` from a generator seeded ``seeds[r]``
    (an exact sample of the processed distribution), records the token's logprob, and returns
    scores that are ``-inf`` everywhere but at the drawn token, so HF's greedy loop picks it. A row's draw
    depends on its seed and its own logits only, never on its batch-mates.
    """

    def __init__(self, sampling: SamplingConfig, seeds: Sequence[int], device: torch.device) -> None:
        self.sampling = sampling
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        self._logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = _warped_logprobs(scores.float(), self.sampling)
        vocab = logp.shape[-1]
        tiny = torch.finfo(torch.float32).tiny
        uniform = torch.stack(
            [torch.rand(vocab, generator=g, device=logp.device, dtype=torch.float32) for g in self.generators]
        )
        gumbel = -torch.log(-torch.log(uniform.clamp_min(tiny)))
        chosen = (logp + gumbel).argmax(dim=-1, keepdim=True)  # [B, 1]
        self._logprobs.append(logp.gather(-1, chosen))
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, chosen, 0.0)

    def logprobs(self) -> torch.Tensor:
        """``[B, T]``: each step's drawn token's logprob."""
        return torch.cat(self._logprobs, dim=1)


class HFGenerator:
    """Generate with a transformers model; see the module docstring."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        *,
        max_model_len: int | None = None,
        max_batch_size: int = 16,
        chat_template: str | None = None,
        reasoning_parser: bool = True,
        tool_parser: str = "auto",
        model_name: str = "gymbridge-hf",
        suppress_token_ids: Sequence[int] | None = None,
    ) -> None:
        """``suppress_token_ids``: extra ids never to sample, on top of the model's media ids;
        ``tool_parser``: the tool-call format (:mod:`gymbridge.generation.tool_calls`; ``auto``: the
        chat template's)."""
        self.model = model
        self.processor = processor
        self.tokenizer: Any = getattr(processor, "tokenizer", processor)
        self.codec = ChatCodec(
            processor,
            chat_template=chat_template,
            reasoning_parser=reasoning_parser,
            tool_parser=tool_parser,
        )
        config = getattr(model.config, "text_config", model.config)
        limit: Any = max_model_len or getattr(config, "max_position_embeddings", 4096)
        self.max_model_len: int = int(limit)
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.max_batch_size = max_batch_size
        self.model_name = model_name
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = int(pad if pad is not None else self.codec.end_of_turn_id)
        from gymbridge.families import GENERIC, family_of

        self.family = family_of(model)
        """The model's family (:mod:`gymbridge.families`): its placeholder, count and token-type rules."""
        if self.family is GENERIC:
            self.family = family_of(processor)
        found = self.family.placeholder_ids(model.config)
        self.image_token_id: int | None = found.get("image")
        self.video_token_id: int | None = found.get("video")
        self.audio_token_id: int | None = found.get("audio")
        self.placeholder_token_ids: dict[str, int | None] = {
            "image": self.image_token_id,
            "video": self.video_token_id,
            "audio": self.audio_token_id,
        }
        """Each modality's placeholder id in this model's prompts (``None``: the model has none)."""
        self.suppressed_token_ids: tuple[int, ...] = tuple(
            sorted(set(media_special_token_ids(model.config)) | set(suppress_token_ids or ()))
        )
        """Ids never sampled (logits masked to ``-inf``); the trainer must mask the same ids."""
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.vocab_size: int | None = getattr(embeddings, "num_embeddings", None)
        """Rows of the input embedding: a prompt id outside ``[0, vocab_size)`` is refused."""
        self._forward_params = frozenset(inspect.signature(model.forward).parameters)
        self._generate_takes_model_defaults = (
            "use_model_defaults" in inspect.signature(model.generate).parameters
        )
        # entered inside the worker thread: not bound to any event loop
        self._lock = WeightGate()
        self._media_cache: MediaCache | None = None
        self.policy_version: int = 0
        """Version of the weights now in :attr:`model` (0: the initial weights)."""
        # seeds of unseeded rows (the global torch RNG is not used for sampling)
        self._entropy = random.SystemRandom()

    @classmethod
    def tiny(cls, seed: int = 0, **kwargs: Any) -> HFGenerator:
        """The tiny offline random-weight Qwen2-VL (nothing downloaded)."""
        from gymbridge.models.tiny_vlm import build_tiny_vlm

        tiny = build_tiny_vlm(seed)
        kwargs.setdefault("model_name", f"gymbridge-tiny-qwen2-vl-seed{seed}")
        return cls(tiny.model, tiny.processor, **kwargs)

    @classmethod
    def tiny_omni(cls, seed: int = 0, **kwargs: Any) -> HFGenerator:
        """The tiny offline random-weight Qwen2.5-Omni thinker (image, video, audio; nothing downloaded)."""
        from gymbridge.models.tiny_omni import build_tiny_omni

        tiny = build_tiny_omni(seed)
        kwargs.setdefault("model_name", f"gymbridge-tiny-qwen2.5-omni-seed{seed}")
        return cls(tiny.model, tiny.processor, **kwargs)

    @classmethod
    def tiny_family(cls, family: str, seed: int = 0, **kwargs: Any) -> HFGenerator:
        """A private copy of the tiny offline model of ``family`` (:mod:`gymbridge.models.tiny_families`)."""
        from gymbridge.models.tiny_families import tiny_family_policy, tiny_model

        tiny = tiny_model(family, seed)
        kwargs.setdefault("model_name", tiny.name)
        return cls(tiny_family_policy(family, seed), tiny.processor, **kwargs)

    @classmethod
    def from_pretrained(
        cls, path: str, *, dtype: str = "float32", device: str | None = None, **kwargs: Any
    ) -> HFGenerator:
        """Load a model and its processor from a local directory (no hub access).

        Uses ``AutoProcessor``; where that cannot load (Qwen-VL's and InternVL's full processors
        need torchvision for video), the saved processor class without its video processor
        (:func:`~gymbridge.families.load_image_only_processor`: images only); else, for a Qwen-VL
        tokenizer without a saved processor, ``AutoTokenizer`` + ``AutoImageProcessor`` with
        Qwen-VL placeholder expansion of the model's own image placeholder
        (:func:`image_placeholder_token`: ``<|image_pad|>``, Qwen2.5-Omni's ``<|IMAGE|>``); else a
        text-only tokenizer.
        """
        import transformers

        check_safetensors_weights(path)
        torch_dtype = getattr(torch, dtype)
        processor: Any
        try:
            processor = transformers.AutoProcessor.from_pretrained(  # type: ignore[no-untyped-call]
                path, local_files_only=True
            )
        except (OSError, ValueError, ImportError) as exc:
            from gymbridge.families import load_image_only_processor

            logger.info("AutoProcessor failed for %s (%s); loading it without video", path, exc)
            processor = load_image_only_processor(path) or _tokenizer_processor(path)
        model: Any = None
        for auto in ("AutoModelForImageTextToText", "AutoModelForVision2Seq", "AutoModelForCausalLM"):
            loader = getattr(transformers, auto, None)
            if loader is None:
                continue
            try:
                model = loader.from_pretrained(
                    path, dtype=torch_dtype, local_files_only=True, use_safetensors=True
                )
                break
            except (ValueError, KeyError):
                continue
        if model is None:
            raise ValueError(f"no transformers auto class can load a generative model from {path!r}")
        model = model.to(device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
        kwargs.setdefault("model_name", path)
        return cls(model, processor, **kwargs)

    # ------------------------------------------------------------------ generation

    async def generate(self, inputs: Sequence[GenerationInput], sampling: SamplingConfig) -> list[Generation]:
        return await self.generate_rows(inputs, sampling, row_seeds(sampling.seed, len(inputs)))

    async def generate_rows(
        self, inputs: Sequence[GenerationInput], sampling: SamplingConfig, seeds: Sequence[int | None]
    ) -> list[Generation]:
        """Row ``j`` sampled from its own stream seeded ``seeds[j]`` (``None``: fresh entropy).

        The rows share forward passes (chunks of :attr:`max_batch_size`); a row's tokens do not
        depend on its batch-mates (:class:`~gymbridge.generation.types.RowSeededGenerator`).
        """
        if len(seeds) != len(inputs):
            raise ValueError(f"{len(seeds)} seeds for {len(inputs)} inputs")
        row_seeds = [self._entropy.getrandbits(63) if s is None else s for s in seeds]
        # each row's max_tokens is lowered to its own room only: rows sharing a forward pass
        # share one GenerationConfig, so rows are grouped by their fitted sampling
        groups: dict[SamplingConfig, list[int]] = {}
        unseeded = replace(sampling, seed=None)  # the rows' seeds travel apart
        for index, inp in enumerate(inputs):
            fitted = fit_max_tokens(len(inp.prompt_token_ids), unseeded, self.max_model_len)
            groups.setdefault(fitted, []).append(index)
        out: list[Generation | None] = [None] * len(inputs)
        for fitted, indices in groups.items():
            for start in range(0, len(indices), self.max_batch_size):
                chunk = indices[start : start + self.max_batch_size]
                gens = await asyncio.to_thread(
                    self._generate_locked, [inputs[i] for i in chunk], fitted, [row_seeds[i] for i in chunk]
                )
                for i, gen in zip(chunk, gens, strict=True):
                    out[i] = gen
        return [g for g in out if g is not None]

    @property
    def weights_lock(self) -> WeightGate:
        """Held for a whole generate or scoring call; publications stage their swap with it
        (:meth:`~gymbridge.generation.weights.WeightGate.stage`) instead of waiting for the call."""
        return self._lock

    def _generate_locked(
        self, inputs: list[GenerationInput], sampling: SamplingConfig, seeds: list[int]
    ) -> list[Generation]:
        with self._lock:
            return self._generate_sync(inputs, sampling, seeds)

    def check_token_ids(self, token_ids: Sequence[int], where: str) -> None:
        """``ProtocolError`` unless every id indexes the model's embedding (a bad id would crash it)."""
        bad = next(
            (t for t in token_ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)), None
        )
        if bad is not None:
            raise ProtocolError(
                f"{where}: token id {bad} is out of range [0, {self.vocab_size}) for this model's vocabulary"
            )

    def use_media_cache(self, cache: MediaCache | None) -> None:
        """Reuse processor outputs by content key from ``cache`` (the model server attaches its own)."""
        self._media_cache = cache

    def media_kwargs(self, inputs: Sequence[GenerationInput]) -> dict[str, Any]:
        """Model inputs for the rows' media (images, videos, audio), placeholder-checked per modality.

        Each medium goes through :func:`~gymbridge.tensors.processor.process_decoded` (the
        function the trainer's batches use), one at a time; a modality's tensors are
        concatenated in row order, then in the order of the row's media. With a media cache
        (:meth:`use_media_cache`, the model server's) a medium's tensors are computed once per
        content key (``GenerationInput.media`` gives the keys).
        """
        from gymbridge.tensors.processor import process_cached, process_decoded, sub_processors

        subs = sub_processors(self.processor)
        per_key: dict[str, list[torch.Tensor]] = {}
        for i, inp in enumerate(inputs):
            for modality in inp.multi_modal_data:
                if modality not in self.placeholder_token_ids:
                    raise ProtocolError(f"input {i}: unknown media modality {modality!r}")
            for modality, token_id in self.placeholder_token_ids.items():
                items = list(inp.multi_modal_data.get(modality, []))
                have = sum(1 for t in inp.prompt_token_ids if t == token_id) if token_id is not None else 0
                if not items:
                    if have:
                        raise ProtocolError(
                            f"input {i}: prompt holds {modality} placeholders but no "
                            f"{_PLURAL[modality]} were given"
                        )
                    continue
                sub = subs.get(modality)
                if sub is None:
                    raise ProtocolError(f"this model's processor cannot take {modality} (input {i})")
                want = 0
                keys = [m.key for m in inp.media if m.modality == modality]
                cache = self._media_cache if len(keys) == len(items) else None
                for j, item in enumerate(items):
                    try:
                        if cache is not None:
                            outputs = process_cached(cache, modality, sub, keys[j], _constant(item))
                        else:
                            outputs = process_decoded(modality, sub, item)
                    except Exception as exc:
                        name = type(sub).__name__
                        raise ProtocolError(
                            f"input {i}: {name} failed on a {modality}: {type(exc).__name__}: {exc}"
                        ) from exc
                    want += self.family.num_placeholders(modality, outputs, self.processor) or 0
                    for key, value in outputs.items():
                        per_key.setdefault(key, []).append(value)
                if token_id is not None and have != want:
                    raise ProtocolError(
                        f"input {i}: the prompt holds {have} {modality} placeholder tokens but its "
                        f"{len(items)} {modality}(s) need {want}: the prompt and the media are out of step "
                        "(stale prompt?)"
                    )
        device = self.model.device
        return {k: torch.cat(v, dim=0).to(device) for k, v in per_key.items()}

    def model_inputs(self, ids: torch.Tensor, mask: torch.Tensor, media: dict[str, Any]) -> dict[str, Any]:
        """Keyword inputs of the model for ``[B, L]`` token ids, their mask and the media kwargs.

        The family's per-token inputs come with the media (Qwen's ``mm_token_type_ids``, Gemma 3's
        ``token_type_ids``: :meth:`~gymbridge.families.ModelFamily.token_type_kwargs`), computed
        the way the trainer computes them.
        """
        from gymbridge.tensors.processor import MEDIA_KEY_MODALITY, forward_media_kwargs

        device = self.model.device
        try:
            named = forward_media_kwargs(media, self._forward_params)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from exc
        kwargs: dict[str, Any] = {"input_ids": ids.to(device), "attention_mask": mask.to(device), **named}
        present = {MEDIA_KEY_MODALITY.get(k, "other") for k in media}
        types = self.family.token_type_kwargs(self.model.config, ids, present, self._forward_params)
        kwargs.update({k: v.to(device) for k, v in types.items()})
        return kwargs

    def _generation_config(self, sampling: SamplingConfig) -> Any:
        """HF's greedy loop: the argmax of the processed scores. Sampling happens in a
        :class:`_RowSampler` on those scores, which leaves one finite score per row (its draw)."""
        from transformers import GenerationConfig

        stops = sorted(set(self.codec.stop_token_ids) | set(sampling.stop_token_ids))
        common: dict[str, Any] = {
            "max_new_tokens": sampling.max_tokens,
            "eos_token_id": stops,
            "pad_token_id": self.pad_token_id,
            "return_dict_in_generate": True,
            # greedy reads the logprobs off the scores; the row sampler records its own
            "output_scores": sampling.temperature == 0.0,
        }
        if self.suppressed_token_ids:
            # SuppressTokensLogitsProcessor runs before the row sampler's temperature / top-p,
            # so the logprobs are of the masked distribution
            common["suppress_tokens"] = list(self.suppressed_token_ids)
        return GenerationConfig(do_sample=False, **common)  # type: ignore[no-untyped-call]

    def _generate_sync(
        self, inputs: list[GenerationInput], sampling: SamplingConfig, seeds: list[int]
    ) -> list[Generation]:
        media = self.media_kwargs(inputs)
        longest = max(len(i.prompt_token_ids) for i in inputs)
        device = self.model.device
        ids = torch.full((len(inputs), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), longest), dtype=torch.long)
        for r, inp in enumerate(inputs):
            n = len(inp.prompt_token_ids)
            if n == 0:
                raise ProtocolError(f"input {r}: empty prompt")
            self.check_token_ids(inp.prompt_token_ids, f"input {r}")
            ids[r, longest - n :] = torch.tensor(inp.prompt_token_ids, dtype=torch.long)
            mask[r, longest - n :] = 1
        config = self._generation_config(sampling)
        stops = set(config.eos_token_id)
        version = self.policy_version
        sampler = None if sampling.temperature == 0.0 else _RowSampler(sampling, seeds, device)
        from transformers import LogitsProcessorList

        extra = LogitsProcessorList([sampler] if sampler is not None else [])
        # a checkpoint's own generation_config (Qwen2-VL-Instruct's: top_k 1, temperature 0.01)
        # must not add HF's warpers in front of the row sampler: transformers 4.x fills every
        # setting left at its global default (do_sample=False included) from it unless told not to
        defaults = {"use_model_defaults": False} if self._generate_takes_model_defaults else {}
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]), torch.no_grad():
            out = self.model.generate(
                **self.model_inputs(ids, mask, media),
                generation_config=config,
                logits_processor=extra,
                **defaults,
            )
        new_tokens = out.sequences[:, longest:]  # [B, T]
        if sampler is not None:
            logps = sampler.logprobs()  # [B, T]
        else:
            # the chosen token's logprob, step by step: never a [B, T, V] copy (tens of GB for a
            # real vocabulary at B=64, T=1024) and only [B, T] numbers leave the device
            logps = torch.cat(
                [
                    torch.log_softmax(s.float(), dim=-1).gather(-1, new_tokens[:, t : t + 1].to(s.device))
                    for t, s in enumerate(out.scores)
                ],
                dim=1,
            )
        steps = logps.shape[1]
        new_tokens = new_tokens[:, :steps]
        token_rows: list[list[int]] = new_tokens.cpu().tolist()
        logp_rows: list[list[float]] = logps.cpu().tolist()
        results: list[Generation] = []
        for inp, row_tokens, row_logps in zip(inputs, token_rows, logp_rows, strict=True):
            end = next((t + 1 for t, tok in enumerate(row_tokens) if tok in stops), None)
            finish: FinishReason = "length" if end is None else "stop"
            n = steps if end is None else end
            results.append(
                Generation(row_tokens[:n], row_logps[:n], finish, list(inp.prompt_token_ids), version)
            )
        logger.debug("generated %d rows, %d steps", len(inputs), steps)
        return results

    # ------------------------------------------------------------------ teacher forcing

    def processed_logprobs(self, logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
        """``[T, V]`` logits -> log-probabilities under ``sampling`` (media mask, temperature, top-p)."""
        return _warped_logprobs(suppress_logits(logits.float(), self.suppressed_token_ids), sampling)

    def score_sync(
        self, inp: GenerationInput, continuation: Sequence[int], sampling: SamplingConfig
    ) -> list[float]:
        """Teacher-forced logprobs of ``continuation`` after ``inp``'s prompt, under ``sampling``."""
        if not inp.prompt_token_ids:
            raise ProtocolError("scored input: empty prompt (nothing to condition the continuation on)")
        full = list(inp.prompt_token_ids) + list(continuation)
        self.check_token_ids(full, "scored input")
        media = self.media_kwargs([inp])
        ids = torch.tensor([full], dtype=torch.long)
        with torch.no_grad():
            logits = self.model(**self.model_inputs(ids, torch.ones_like(ids), media)).logits[0]
        p = len(inp.prompt_token_ids)
        lp = self.processed_logprobs(logits[p - 1 : len(full) - 1], sampling)
        idx = torch.tensor(list(continuation), device=lp.device)
        return [float(x) for x in lp.gather(-1, idx[:, None])[:, 0].cpu()]

    async def score(
        self,
        inputs: Sequence[GenerationInput],
        continuations: Sequence[Sequence[int]],
        sampling: SamplingConfig,
    ) -> list[Generation]:
        """Force ``continuations`` (e.g. scripted turns) and report their logprobs like :meth:`generate`."""
        out: list[Generation] = []
        stops = set(self.codec.stop_token_ids) | set(sampling.stop_token_ids)
        for inp, cont in zip(inputs, continuations, strict=True):
            lps, version = await asyncio.to_thread(self._score_locked, inp, cont, sampling)
            finish: FinishReason = "stop" if cont and cont[-1] in stops else "length"
            out.append(Generation(list(cont), lps, finish, list(inp.prompt_token_ids), version))
        return out

    def _score_locked(
        self, inp: GenerationInput, cont: Sequence[int], sampling: SamplingConfig
    ) -> tuple[list[float], int]:
        with self._lock:
            return self.score_sync(inp, cont, sampling), self.policy_version
