"""Tiny random-weight models of the VLM families people train, built offline: one registry.

``tiny_model(family, seed)`` returns a :class:`TinyModel` for each name in :data:`TINY_FAMILIES`:
the family's **real** architecture class from a small config (text hidden 64, 2 layers; vision
encoder 2 layers), the family's **real** processor class around its torchvision-free image
processor (``Qwen2VLImageProcessorPil``, ``Gemma3ImageProcessorPil``,
``GotOcr2ImageProcessorPil``), a byte-level BPE tokenizer trained in code on the tiny VLM's
corpus that carries the family's special tokens (ids ``0..k-1``, named where the processor reads
them: ``tokenizer.boi_token``, ``tokenizer.context_image_token``), and a chat template with the
family's image rendering and Hermes ``<tool_call>`` / ``<tool_response>`` tools:

* ``qwen2_vl``: the default tiny model (:mod:`.tiny_vlm`; its own Qwen-style processor);
* ``qwen2_5_vl``: ``Qwen2_5_VLForConditionalGeneration`` / ``Qwen2_5_VLProcessor``; the template's
  ``<|vision_start|><|image_pad|><|vision_end|>`` becomes ``<|image_pad|>`` x ``grid / merge**2``;
  the encoder mixes windowed and global attention layers; videos too (``<|video_pad|>`` and the
  processor's ``second_per_grid_ts``), through :class:`~gymbridge.models.tiny_omni.TinyVideoProcessor`;
* ``qwen3_vl``: ``Qwen3VLForConditionalGeneration`` / ``Qwen3VLProcessor``; as Qwen2.5-VL with
  16-pixel patches, DeepStack features and interleaved M-RoPE;
* ``gemma3``: ``Gemma3ForConditionalGeneration`` / ``Gemma3Processor``; ``<start_of_image>`` becomes
  ``\\n\\n<start_of_image>`` + ``<image_soft_token>`` x 4 + ``<end_of_image>\\n\\n``;
* ``internvl``: ``InternVLForConditionalGeneration`` / ``InternVLProcessor``; ``<IMG_CONTEXT>\\n``
  becomes ``<img>`` + ``<IMG_CONTEXT>`` x 4 per 56-pixel tile (up to 4 tiles and a thumbnail) +
  ``</img>``;
* ``qwen2_5_omni``: the Qwen2.5-Omni thinker (:mod:`.tiny_omni`: images, video and audio).

The Qwen2.5-VL, Qwen3-VL and InternVL processors are the real classes with their declared video
sub-processor left out (:func:`~gymbridge.families.image_only_processor`: those classes need
torchvision, which must never be installed beside the CPU torch here); Qwen3-VL's and InternVL's
take images and refuse video, Qwen2.5-VL's gets the torchvision-free one above. Gemma 3 has
no tool format of its own: its template renders the Hermes one inside Gemma turns
(``<start_of_turn>model``, tool results as a user turn). The tiny Gemma 3 keeps the architecture's
sliding-window layers (window 32 tokens, one sliding and one global layer), so its windows matter
at these lengths; its image projection is drawn at random like every other weight
(transformers starts it at zero, which would hide the images from a random model).

Invariants: nothing is downloaded; weights come from ``torch.manual_seed(seed)`` with the global
RNG restored; each config's special token ids equal the tokenizer's; ``tiny_model`` is cached per
``(family, seed)`` and thread-safe (treat the result as read-only; :func:`tiny_family_policy`
gives a private trainable copy). :func:`parse_tiny_spec` is the one parser of ``tiny:FAMILY``
model specs (``gymbridge model serve --model``, ``gymbridge smoke run --model``,
``gymbridge train --model``).
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gymbridge.families import image_only_processor

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TINY_FAMILY",
    "TINY_FAMILIES",
    "TINY_PREFIX",
    "TinyModel",
    "parse_tiny_spec",
    "tiny_family_policy",
    "tiny_model",
]

TINY_PREFIX = "tiny:"
"""Model specs naming a tiny family start with this (``tiny:gemma3``)."""
DEFAULT_TINY_FAMILY = "qwen2_vl"
TINY_FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "internvl", "qwen2_5_omni")
"""Every tiny family :func:`tiny_model` builds."""

_PATCH = 14
_MERGE = 2
_TEMPORAL = 2
_HIDDEN = 64


@dataclass(frozen=True)
class TinyModel:
    """A tiny model of one family, its processor and tokenizer, and its media token ids."""

    family: str
    model: Any
    """The family's ``...ForConditionalGeneration`` in eval mode, fp32, CPU, random weights."""
    processor: Any
    tokenizer: Any
    seed: int
    placeholder_token_ids: dict[str, int]
    """Modality -> the token an item's placeholder expands to (what the model scatters features into)."""
    modalities: tuple[str, ...] = ("image",)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The model name the servers report (``gymbridge-tiny-<family>-seed<seed>``)."""
        return f"gymbridge-tiny-{self.family.replace('_', '-')}-seed{self.seed}"


def parse_tiny_spec(spec: str) -> str | None:
    """The family a ``tiny:FAMILY`` model spec names (``None`` for any other spec).

    ``tiny:qwen2.5-vl`` and ``tiny:qwen2_5_vl`` are the same family; an unknown family is a
    :class:`~gymbridge.errors.ConfigError` listing the known ones.
    """
    if not spec.startswith(TINY_PREFIX):
        return None
    name = spec[len(TINY_PREFIX) :].strip().lower().replace("-", "_").replace(".", "_")
    if name not in TINY_FAMILIES:
        from gymbridge.errors import ConfigError

        known = ", ".join(f"{TINY_PREFIX}{f}" for f in TINY_FAMILIES)
        raise ConfigError([f"model {spec!r}: no tiny family {name!r}; known: {known}"])
    return name


_BUILD_LOCK = threading.Lock()


def tiny_model(family: str = DEFAULT_TINY_FAMILY, seed: int = 0) -> TinyModel:
    """Build (once per process, family and seed) the tiny model of ``family``; module docstring."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; known: {', '.join(TINY_FAMILIES)}")
    with _BUILD_LOCK:
        return _tiny_model(family, seed)


def tiny_family_policy(family: str, seed: int = 0) -> Any:
    """A private, trainable copy of ``tiny_model(family, seed).model`` (a picklable factory)."""
    return copy.deepcopy(tiny_model(family, seed).model)


@functools.cache
def _tiny_model(family: str, seed: int) -> TinyModel:
    built = _BUILDERS[family](seed)
    logger.debug(
        "built tiny %s (seed=%d, %d parameters)",
        family,
        seed,
        sum(p.numel() for p in built.model.parameters()),
    )
    return built


# ---------------------------------------------------------------------------------------- builders


def _tokens(tokenizer: Any, *names: str) -> dict[str, int]:
    return {name: int(tokenizer.convert_tokens_to_ids(name)) for name in names}


def _qwen2_vl(seed: int) -> TinyModel:
    from gymbridge.models.tiny_vlm import build_tiny_vlm

    vlm = build_tiny_vlm(seed)
    ids = {"image": vlm.image_token_id, "video": vlm.video_token_id}
    return TinyModel("qwen2_vl", vlm.model, vlm.processor, vlm.tokenizer, seed, ids)


def _qwen2_5_omni(seed: int) -> TinyModel:
    from gymbridge.models.tiny_omni import build_tiny_omni

    omni = build_tiny_omni(seed)
    ids = {"image": omni.image_token_id, "video": omni.video_token_id, "audio": omni.audio_token_id}
    return TinyModel(
        "qwen2_5_omni", omni.model, omni.processor, omni.tokenizer, seed, ids, ("image", "video", "audio")
    )


def _qwen_tokenizer() -> Any:
    from gymbridge.models.tiny_vlm import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _qwen_image_processor(patch: int, *, mean: tuple[float, ...] | None = None) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from gymbridge.models.tiny_vlm import TINY_MAX_PIXELS

    factor = patch * _MERGE
    extra: dict[str, Any] = {} if mean is None else {"image_mean": list(mean), "image_std": list(mean)}
    return Qwen2VLImageProcessorPil(
        min_pixels=factor * factor * 4,  # at least 4 merged tokens per image
        max_pixels=max(TINY_MAX_PIXELS, factor * factor * 16),
        patch_size=patch,
        temporal_patch_size=_TEMPORAL,
        merge_size=_MERGE,
        **extra,
    )


def _qwen_ids(tokenizer: Any) -> dict[str, Any]:
    from gymbridge.models.tiny_vlm import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START

    t = _tokens(tokenizer, IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END)
    return {
        "image_token_id": t[IMAGE_PAD],
        "video_token_id": t[VIDEO_PAD],
        "vision_start_token_id": t[VISION_START],
        "vision_end_token_id": t[VISION_END],
    }


def _qwen2_5_vl(seed: int) -> TinyModel:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    from gymbridge.models.tiny_omni import TinyVideoProcessor
    from gymbridge.models.tiny_vlm import END_OF_TEXT, IM_END, seeded_model, tiny_text_config

    tokenizer = _qwen_tokenizer()
    eos, pad = _tokens(tokenizer, IM_END, END_OF_TEXT).values()
    ids = _qwen_ids(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config=tiny_text_config(pad, eos),
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": _HIDDEN,
            "fullatt_block_indexes": [1],  # layer 0 windowed, layer 1 global, as the real encoder mixes them
            "window_size": _PATCH * _MERGE * 2,
            "patch_size": _PATCH,
            "spatial_merge_size": _MERGE,
            "temporal_patch_size": _TEMPORAL,
            "tokens_per_second": 2,
        },
        **ids,
    )
    model = seeded_model(Qwen2_5_VLForConditionalGeneration, config, seed, eos=eos, pad=pad)
    processor = image_only_processor(Qwen2_5_VLProcessor)(
        image_processor=_qwen_image_processor(_PATCH),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    # video: the real processor's expansion and timing (second_per_grid_ts) over a torchvision-free
    # video processor, set after construction (the declared class is checked against torchvision's)
    processor.video_processor = TinyVideoProcessor()
    placeholders = {"image": ids["image_token_id"], "video": ids["video_token_id"]}
    return TinyModel("qwen2_5_vl", model, processor, tokenizer, seed, placeholders, ("image", "video"))


def _qwen3_vl(seed: int) -> TinyModel:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    from gymbridge.models.tiny_vlm import END_OF_TEXT, IM_END, seeded_model, tiny_text_config

    tokenizer = _qwen_tokenizer()
    eos, pad = _tokens(tokenizer, IM_END, END_OF_TEXT).values()
    ids = _qwen_ids(tokenizer)
    text = tiny_text_config(pad, eos)
    text["head_dim"] = text["hidden_size"] // text["num_attention_heads"]
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
    patch = 16  # Qwen3-VL's encoder patch (Qwen2/2.5-VL: 14)
    config = Qwen3VLConfig(
        text_config=text,
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": _HIDDEN,
            "patch_size": patch,
            "spatial_merge_size": _MERGE,
            "temporal_patch_size": _TEMPORAL,
            "num_position_embeddings": 64,  # an 8 x 8 grid of learned positions, interpolated per image
            "deepstack_visual_indexes": [0],  # layer 0's features also go into the LM's first layer
        },
        tie_word_embeddings=False,
        **ids,
    )
    model = seeded_model(Qwen3VLForConditionalGeneration, config, seed, eos=eos, pad=pad)
    processor = image_only_processor(Qwen3VLProcessor)(
        image_processor=_qwen_image_processor(patch, mean=(0.5, 0.5, 0.5)),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    placeholders = {"image": ids["image_token_id"], "video": ids["video_token_id"]}
    return TinyModel("qwen3_vl", model, processor, tokenizer, seed, placeholders)


# Gemma 3: the official template's layout (bos; the system text opens the first user turn; the
# assistant is "model"; an image part is <start_of_image>), with Hermes tools inside Gemma turns.
_GEMMA3_RAW_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}{% set system_text = messages[0]['content'] %}"
    "{% else %}{% set system_text = messages[0]['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{% endif %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system_text = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or loop_messages[loop.index0 - 1]['role'] != 'tool' %}<start_of_turn>user{% endif %}"
    "\n<tool_response>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "\n</tool_response>"
    "{% if loop.last or loop_messages[loop.index0 + 1]['role'] != 'tool' %}<end_of_turn>\n{% endif %}"
    "{% else %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}\n"
    "{% if loop.first %}"
    "{% if system_text %}{{ system_text }}\n\n{% endif %}"
    "{% if tools %}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>\n\n{% endif %}"
    "{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% elif message['content'] is not none %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{% if not loop.first or message['content'] %}\n{% endif %}"
    '<tool_call>\n{"name": "{{ call[\'name\'] }}", "arguments": '
    "{% if call['arguments'] is string %}{{ call['arguments'] }}"
    "{% else %}{{ call['arguments'] | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}{% endif %}"
    "<end_of_turn>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_CHAT_TEMPLATE = _GEMMA3_RAW_TEMPLATE.replace("%}\n", "%}{{ '\\n' }}")
_GEMMA3_SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
_GEMMA3_IMAGE_SIZE = 56
_GEMMA3_TOKENS_PER_IMAGE = 4  # 4 x 4 patches of 14 px, average-pooled 2 x 2


def _gemma3(seed: int) -> TinyModel:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from gymbridge.models.tiny_vlm import build_tiny_tokenizer, seeded_model

    tokenizer = build_tiny_tokenizer(
        _GEMMA3_SPECIAL_TOKENS,
        eos_token="<eos>",
        pad_token="<pad>",
        bos_token="<bos>",
        named_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )
    t = _tokens(tokenizer, *_GEMMA3_SPECIAL_TOKENS)
    pad, end_of_turn = t["<pad>"], t["<end_of_turn>"]
    config = Gemma3Config(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": _HIDDEN,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "max_position_embeddings": 4096,
            "pad_token_id": pad,
            "eos_token_id": t["<eos>"],
            "bos_token_id": t["<bos>"],
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": _GEMMA3_IMAGE_SIZE,
            "patch_size": _PATCH,
            "vision_use_head": False,
        },
        mm_tokens_per_image=_GEMMA3_TOKENS_PER_IMAGE,
        boi_token_index=t["<start_of_image>"],
        eoi_token_index=t["<end_of_image>"],
        image_token_index=t["<image_soft_token>"],
    )
    # generation ends at <end_of_turn>, as the instruction-tuned Gemma 3's generation config says
    model = seeded_model(Gemma3ForConditionalGeneration, config, seed, eos=end_of_turn, pad=pad)
    # transformers starts the image projection at zero (a trained checkpoint never has it so): a random
    # model would not see its images at all, and its vision tower would get no gradient
    projection = model.model.multi_modal_projector.mm_input_projection_weight
    draw = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        projection.copy_(
            torch.randn(projection.shape, generator=draw) * float(config.initializer_range or 0.02)
        )
    image_processor = Gemma3ImageProcessorPil(
        size={"height": _GEMMA3_IMAGE_SIZE, "width": _GEMMA3_IMAGE_SIZE},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=_GEMMA3_TOKENS_PER_IMAGE,
    )
    return TinyModel("gemma3", model, processor, tokenizer, seed, {"image": t["<image_soft_token>"]})


_INTERNVL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<video>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
_INTERNVL_TILE = 56
_INTERNVL_TOKENS_PER_TILE = 4  # 4 x 4 patches of 14 px, pixel-shuffled by 0.5


def _internvl(seed: int) -> TinyModel:
    from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from gymbridge.models.tiny_vlm import (
        build_tiny_tokenizer,
        qwen_chat_template,
        seeded_model,
        tiny_text_config,
    )

    tokenizer = build_tiny_tokenizer(
        _INTERNVL_SPECIAL_TOKENS,
        named_tokens={
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
        chat_template=qwen_chat_template("<IMG_CONTEXT>\n"),
    )
    t = _tokens(tokenizer, *_INTERNVL_SPECIAL_TOKENS)
    eos, pad = t["<|im_end|>"], t["<|endoftext|>"]
    text = tiny_text_config(pad, eos)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}  # 1-D RoPE (Qwen2 LM)
    config = InternVLConfig(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": [_INTERNVL_TILE, _INTERNVL_TILE],
            "patch_size": [_PATCH, _PATCH],
        },
        text_config={"model_type": "qwen2", **text},
        image_token_id=t["<IMG_CONTEXT>"],
        image_seq_length=_INTERNVL_TOKENS_PER_TILE,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    model = seeded_model(InternVLForConditionalGeneration, config, seed, eos=eos, pad=pad)
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": _INTERNVL_TILE, "width": _INTERNVL_TILE},
        crop_to_patches=True,
        min_patches=1,
        max_patches=4,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    )
    processor = image_only_processor(InternVLProcessor)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=_INTERNVL_TOKENS_PER_TILE,
    )
    return TinyModel("internvl", model, processor, tokenizer, seed, {"image": t["<IMG_CONTEXT>"]})


_BUILDERS: dict[str, Callable[[int], TinyModel]] = {
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "gemma3": _gemma3,
    "internvl": _internvl,
    "qwen2_5_omni": _qwen2_5_omni,
}
