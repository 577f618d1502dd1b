"""A tiny, random-weight Qwen2-VL with a tokenizer trained in code: fully offline.

``build_tiny_vlm(seed)`` returns a :class:`TinyVLM`: a ``Qwen2VLForConditionalGeneration``
small enough to generate on CPU in milliseconds (hidden 64, 2 layers, vision depth 2),
a byte-level BPE tokenizer trained with the ``tokenizers`` library on a small built-in
corpus plus the Qwen2-VL special tokens, a Qwen-style chat template (system / user /
assistant / tool roles, images as ``<|vision_start|><|image_pad|><|vision_end|>``, tools
in the Hermes ``<tool_call>`` style), and an image-only processor around
``Qwen2VLImageProcessorPil`` (the stock ``Qwen2VLProcessor`` needs a video processor,
which needs torchvision; we do without).

Invariants:

* nothing is downloaded: the tokenizer is trained from :data:`_CORPUS`, the weights
  are drawn from ``torch.manual_seed(seed)``;
* the model config's special token ids (``image_token_id``, ``vision_start_token_id``,
  ``vision_end_token_id``, ``video_token_id``, eos) equal the tokenizer's;
* the processor expands each ``<|image_pad|>`` in the text to
  ``grid_t * grid_h * grid_w // merge_size**2`` pad tokens, in order, so the token
  stream always agrees with ``image_grid_thw``;
* ``build_tiny_vlm(seed)`` is cached per process: the same seed returns the same
  object, also to concurrent callers (treat it as read-only; ``copy.deepcopy(tiny.model)``
  before training it).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "IMAGE_PAD",
    "SPECIAL_TOKENS",
    "TINY_MAX_PIXELS",
    "TINY_MIN_PIXELS",
    "TinyImageProcessor",
    "TinyVLM",
    "TinyVLMProcessor",
    "build_tiny_tokenizer",
    "build_tiny_vlm",
    "qwen_chat_template",
    "tiny_hf_processor",
]

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
AUDIO_PAD = "<|audio_pad|>"
AUDIO_START = "<|audio_start|>"
AUDIO_END = "<|audio_end|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"

SPECIAL_TOKENS: tuple[str, ...] = (
    END_OF_TEXT,
    IM_START,
    IM_END,
    VISION_START,
    VISION_END,
    IMAGE_PAD,
    VIDEO_PAD,
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
"""Special tokens, in id order: ``SPECIAL_TOKENS[i]`` has token id ``i``."""

OMNI_SPECIAL_TOKENS: tuple[str, ...] = (*SPECIAL_TOKENS, AUDIO_START, AUDIO_PAD, AUDIO_END)
"""The tiny omni model's special tokens: the VLM's (same ids) plus the audio ones."""

TINY_MIN_PIXELS = 28 * 28 * 4
"""Smallest resized image area (pixels): at least 4 merged tokens per image."""
TINY_MAX_PIXELS = 224 * 224
"""Largest resized image area: a 448x448 image becomes 224x224 -> grid 16x16 -> 64 tokens."""

_VOCAB_SIZE = 512
_PATCH_SIZE = 14
_MERGE_SIZE = 2
_TEMPORAL_PATCH = 2

_CORPUS: tuple[str, ...] = (
    "You are a helpful assistant. Look at the image and answer the question.",
    "The red square is in the top left corner of the picture.",
    "Click on the blue circle. The answer is 42.",
    "Call the tool to zoom into the region, then describe what you see.",
    '{"name": "zoom", "arguments": {"x": 10, "y": 20, "scale": 2}}',
    "What color is the object? It is green. It is yellow. It is black and white.",
    "Let me think step by step about this problem before I answer.",
    "The environment returned an observation: you moved north and found a key.",
    "user assistant system tool function call output message reasoning",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 100 256 512 1024",
    "The quick brown fox jumps over the lazy dog. A B C D E F G H I J K L M N O P",
    "Count the objects: one, two, three, four, five. There are five objects.",
    "Sorry, I cannot see that. Please try again with a different request.",
    "<tools> </tools> Available functions are listed in JSON below.",
    # Each colour name alone: a one-token answer word (no leading space) for the colour tasks.
    "red",
    "green",
    "blue",
    "yellow",
)

# Qwen2-VL style chat template, extended with Hermes tool rendering, a tool role, and video /
# audio parts (Qwen2.5-Omni's layout: each medium between its boundary tokens). HF renders
# templates with trim_blocks, which eats a newline right after a block tag: those newlines are
# re-emitted as expressions below.
_RAW_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}{{ messages[0]['content'] }}"
    "{% else %}{% for part in messages[0]['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% else %}You are a helpful assistant.{% endif %}"
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{% if not loop.first or message['content'] %}\n{% endif %}"
    '<tool_call>\n{"name": "{{ call[\'name\'] }}", "arguments": '
    "{% if call['arguments'] is string %}{{ call['arguments'] }}"
    "{% else %}{{ call['arguments'] | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CHAT_TEMPLATE = _RAW_CHAT_TEMPLATE.replace("%}\n", "%}{{ '\\n' }}")


def qwen_chat_template(image: str = "<|vision_start|><|image_pad|><|vision_end|>") -> str:
    """The Qwen-style chat template (Hermes tools, a tool role) with ``image`` as each image part's text.

    Qwen2-VL / Qwen2.5-VL / Qwen3-VL write ``<|vision_start|><|image_pad|><|vision_end|>``;
    InternVL (a Qwen2.5 language model) writes ``<IMG_CONTEXT>\\n``.
    """
    return _CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", image)


def build_tiny_tokenizer(
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    *,
    eos_token: str = IM_END,
    pad_token: str = END_OF_TEXT,
    bos_token: str | None = None,
    named_tokens: dict[str, str] | None = None,
    chat_template: str | None = None,
) -> Any:
    """Train a byte-level BPE tokenizer on the built-in corpus; return a ``PreTrainedTokenizerFast``.

    Deterministic: the same corpus and settings always give the same vocabulary.
    Special tokens get ids ``0..len(special_tokens)-1`` in their order (default
    :data:`SPECIAL_TOKENS`; the omni model passes :data:`OMNI_SPECIAL_TOKENS`, the other tiny
    families their own, :mod:`gymbridge.models.tiny_families`). ``named_tokens`` become the
    tokenizer's named special tokens (``tokenizer.boi_token`` / ``boi_token_id``, what a
    family's processor reads); ``chat_template`` defaults to the Qwen-style template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    fast_cls: Any = PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    reserved = {eos_token, pad_token, bos_token}
    extra: dict[str, Any] = {"bos_token": bos_token} if bos_token is not None else {}
    extra.update(named_tokens or {})  # ``*_token`` keywords: the tokenizer's named special tokens
    fast = fast_cls(
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token=pad_token,
        additional_special_tokens=[t for t in special_tokens if t not in reserved],
        **extra,
    )
    fast.chat_template = chat_template if chat_template is not None else _CHAT_TEMPLATE
    for i, name in enumerate(special_tokens):
        got = fast.convert_tokens_to_ids(name)
        if got != i:  # pragma: no cover - guards the tokenizers library's id assignment
            raise RuntimeError(f"special token {name!r} got id {got}, expected {i}")
    return fast


class TinyImageProcessor:
    """Factory for the image processor the tiny model uses (a configured ``Qwen2VLImageProcessorPil``)."""

    @staticmethod
    def build(min_pixels: int = TINY_MIN_PIXELS, max_pixels: int = TINY_MAX_PIXELS) -> Any:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            patch_size=_PATCH_SIZE,
            temporal_patch_size=_TEMPORAL_PATCH,
            merge_size=_MERGE_SIZE,
        )


class TinyVLMProcessor:
    """Qwen-style processor: tokenizer + image processor (+ optional video processor and audio extractor).

    ``processor(text=..., images=..., videos=..., audio=...)`` returns a ``BatchFeature`` with
    ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` and the media tensors
    (``pixel_values`` / ``image_grid_thw``; ``pixel_values_videos`` / ``video_grid_thw`` /
    ``video_second_per_grid``; ``input_features`` / ``feature_attention_mask``), made by
    :func:`gymbridge.tensors.processor.process_decoded` one medium at a time, the function the
    trainer's batches use. Each ``<|image_pad|>`` / ``<|video_pad|>`` / ``<|audio_pad|>`` in the
    text is expanded to its medium's placeholder count, media consumed in order per modality;
    the number of placeholders of a modality must equal the number of its media (``ValueError``
    otherwise). Without a ``video_processor`` / ``feature_extractor`` the processor takes images
    only (the tiny Qwen2-VL's case). ``image_token`` respells the image placeholder (Qwen2.5-Omni's
    ``<|IMAGE|>``; ``HFGenerator.from_pretrained`` reads it from the saved config).
    """

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        video_processor: Any | None = None,
        feature_extractor: Any | None = None,
        *,
        image_token: str = IMAGE_PAD,
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        if video_processor is not None:
            self.video_processor = video_processor
        if feature_extractor is not None:
            self.feature_extractor = feature_extractor
        self.image_token = image_token
        self.image_token_id: int = int(tokenizer.convert_tokens_to_ids(image_token))
        self.video_token = VIDEO_PAD
        self.video_token_id: int = int(tokenizer.convert_tokens_to_ids(VIDEO_PAD))
        self.audio_token: str | None = AUDIO_PAD if feature_extractor is not None else None
        self.audio_token_id: int | None = (
            int(tokenizer.convert_tokens_to_ids(AUDIO_PAD)) if feature_extractor is not None else None
        )
        self.chat_template: str = tokenizer.chat_template

    @property
    def merge_size(self) -> int:
        return int(self.image_processor.merge_size)

    def num_image_tokens(self, image_grid_thw: torch.Tensor) -> list[int]:
        """Merged placeholder tokens per image for a ``[N, 3]`` grid tensor."""
        counts = image_grid_thw.to(torch.int64).prod(dim=-1) // (self.merge_size**2)
        return [int(c) for c in counts.tolist()]

    def mm_token_type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Per-token modality ids ``[B, L]`` (0 text, 1 image, 2 video) that Qwen-VL's M-RoPE needs."""
        types = (input_ids == self.image_token_id).to(torch.int64)
        return types + 2 * (input_ids == self.video_token_id).to(torch.int64)

    def apply_chat_template(self, conversation: Sequence[dict[str, Any]], **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(list(conversation), **kwargs)

    def _media(self, modality: str, media: Any, data: dict[str, Any]) -> list[int]:
        """Process ``media`` of one modality into ``data`` (concatenated); placeholder count per medium."""
        from gymbridge.tensors.processor import num_placeholders, process_decoded

        items = [] if media is None else list(media) if isinstance(media, list | tuple) else [media]
        if modality == "audio" and isinstance(media, tuple) and len(media) == 2 and isinstance(media[1], int):
            items = [media]  # one (waveform, rate) pair
        if not items:
            return []
        sub = {"image": self.image_processor}.get(modality) or getattr(
            self, "video_processor" if modality == "video" else "feature_extractor", None
        )
        if sub is None:
            raise ValueError(f"this processor takes no {modality}")
        outputs = [process_decoded(modality, sub, item) for item in items]
        for key in outputs[0]:
            data[key] = torch.cat([o[key] for o in outputs], dim=0)
        return [int(num_placeholders(modality, o, sub) or 0) for o in outputs]

    def __call__(
        self,
        text: str | Sequence[str] | None = None,
        images: Any = None,
        videos: Any = None,
        audio: Any = None,
        return_tensors: str | None = "pt",
        padding: bool | str = True,
        **kwargs: Any,
    ) -> Any:
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text or [])
        data: dict[str, Any] = {}
        pads = (
            (self.image_token, "image", images),
            (VIDEO_PAD, "video", videos),
            (AUDIO_PAD, "audio", audio),
        )
        counts: dict[str, list[int]] = {}
        for pad, modality, media in pads:
            plural = "audio clips" if modality == "audio" else f"{modality}s"
            counts[pad] = self._media(modality, media, data)
            total = sum(t.count(pad) for t in texts)
            if total != len(counts[pad]):
                raise ValueError(
                    f"text holds {total} {pad} placeholders but {len(counts[pad])} {plural} given"
                )
        expanded: list[str] = []
        cursors = dict.fromkeys(counts, 0)
        for t in texts:
            out = t
            for pad, _, _ in pads:  # each pad string is split once, so its expansion is never re-split
                pieces = out.split(pad)
                out = pieces[0]
                for piece in pieces[1:]:
                    out += pad * counts[pad][cursors[pad]] + piece
                    cursors[pad] += 1
            expanded.append(out)
        if texts:
            enc = self.tokenizer(expanded, return_tensors=return_tensors, padding=padding, **kwargs)
            data["input_ids"] = enc["input_ids"]
            data["attention_mask"] = enc["attention_mask"]
            data["mm_token_type_ids"] = self.mm_token_type_ids(enc["input_ids"])
        return BatchFeature(data=data, tensor_type=None)

    def batch_decode(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer.decode(*args, **kwargs)


@functools.cache
def _hf_processor_class() -> Any:
    from transformers import ProcessorMixin, Qwen2VLProcessor

    class TinyQwen2VLProcessor(Qwen2VLProcessor):
        """``Qwen2VLProcessor`` without its video half (the stock video processor needs torchvision)."""

        def __init__(
            self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
        ) -> None:
            self.image_token = IMAGE_PAD
            self.video_token = VIDEO_PAD
            self.image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE_PAD))
            self.video_token_id = int(tokenizer.convert_tokens_to_ids(VIDEO_PAD))
            init: Any = ProcessorMixin.__init__  # untyped in transformers
            init(self, image_processor, tokenizer, chat_template=chat_template)

    return TinyQwen2VLProcessor


def tiny_hf_processor(tokenizer: Any | None = None) -> Any:
    """The tiny model's tokenizer and image processor as a transformers ``ProcessorMixin``.

    A ``Qwen2VLProcessor`` (subclass) over :func:`build_tiny_tokenizer` and the tiny image
    processor, images only: what trainers that dispatch on ``ProcessorMixin`` (TRL) or on the
    processor's class (verl) need, where :class:`TinyVLMProcessor` is gymbridge's own duck-typed
    one. It expands each ``<|image_pad|>`` exactly as :class:`TinyVLMProcessor` does and carries
    the same chat template. ``tokenizer`` defaults to a fresh :func:`build_tiny_tokenizer`.
    """
    tok = build_tiny_tokenizer() if tokenizer is None else tokenizer
    return _hf_processor_class()(TinyImageProcessor.build(), tok, chat_template=tok.chat_template)


@dataclass(frozen=True)
class TinyVLM:
    """The tiny model, its processor and tokenizer, and the special token ids."""

    model: Any
    """``Qwen2VLForConditionalGeneration`` in eval mode, fp32, CPU, random weights."""
    processor: TinyVLMProcessor
    tokenizer: Any
    """``PreTrainedTokenizerFast`` with the chat template set."""
    seed: int
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_id: int
    pad_token_id: int
    im_start_token_id: int


def tiny_text_config(pad: int, eos: int) -> dict[str, Any]:
    """The tiny models' language model: hidden 64, 2 layers, 4 heads (2 KV), M-RoPE sections [2, 3, 3]."""
    return {
        "vocab_size": _VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": pad,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }


def seeded_model(model_class: Any, config: Any, seed: int, *, eos: int, pad: int) -> Any:
    """``model_class(config)`` with weights drawn from ``torch.manual_seed(seed)`` (the global RNG restored),
    fp32, eval mode, its generation config's eos / pad / bos set."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model: Any = model_class(config)
    finally:
        torch.random.set_rng_state(state)
    model = model.to(dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.generation_config.bos_token_id = pad
    return model


_BUILD_LOCK = threading.Lock()


def build_tiny_vlm(seed: int = 0) -> TinyVLM:
    """Build (once per process and seed) the tiny offline Qwen2-VL; see the module docstring.

    Thread-safe: concurrent callers wait for one build (``functools.cache`` alone lets each
    build its own, and seeding the global RNG from two threads mixes their weights).
    """
    with _BUILD_LOCK:
        return _build_tiny_vlm(seed)


@functools.cache
def _build_tiny_vlm(seed: int) -> TinyVLM:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokenizer = build_tiny_tokenizer()

    def tid(name: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(name))

    eos = tid(IM_END)
    pad = tid(END_OF_TEXT)
    config = Qwen2VLConfig(
        text_config=tiny_text_config(pad, eos),
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": _PATCH_SIZE,
            "spatial_merge_size": _MERGE_SIZE,
            "temporal_patch_size": _TEMPORAL_PATCH,
        },
        image_token_id=tid(IMAGE_PAD),
        video_token_id=tid(VIDEO_PAD),
        vision_start_token_id=tid(VISION_START),
        vision_end_token_id=tid(VISION_END),
    )
    model = seeded_model(Qwen2VLForConditionalGeneration, config, seed, eos=eos, pad=pad)
    processor = TinyVLMProcessor(tokenizer, TinyImageProcessor.build())
    logger.debug(
        "built tiny Qwen2-VL (seed=%d, %d parameters)", seed, sum(p.numel() for p in model.parameters())
    )
    return TinyVLM(
        model=model,
        processor=processor,
        tokenizer=tokenizer,
        seed=seed,
        image_token_id=tid(IMAGE_PAD),
        video_token_id=tid(VIDEO_PAD),
        vision_start_token_id=tid(VISION_START),
        vision_end_token_id=tid(VISION_END),
        eos_token_id=eos,
        pad_token_id=pad,
        im_start_token_id=tid(IM_START),
    )
