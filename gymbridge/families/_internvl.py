"""InternVL (transformers' ``InternVLForConditionalGeneration``: InternVL3 and later in HF format).

* The template writes ``<IMG_CONTEXT>\\n`` per image; ``InternVLProcessor`` tiles the image into
  up to ``max_patches`` crops (plus a thumbnail when there is more than one) and replaces the
  placeholder with ``<img>`` + ``<IMG_CONTEXT>`` x (tiles x ``image_seq_length``) + ``</img>``.
* ``pixel_values`` is ``[tiles, 3, H, W]`` per image, concatenated over images; an item's count
  is its tiles times ``image_seq_length`` (``config.image_seq_length`` on the model side);
  ``num_patches`` only sizes the text and never reaches the model.
* No token types; positions are 1-D (its language model is a Qwen2 / Llama one).
* The encoder is ``get_image_features(pixel_values)``: one ``[tokens, hidden]`` block per tile.
* vLLM serves it with its InternS1 implementation, whose processor replaces ``<IMG_CONTEXT>``
  with the whole ``<img>...</img>`` block: the vLLM prompt cuts each block back to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from gymbridge.families._base import ModelFamily, referenced_rows

if TYPE_CHECKING:
    from gymbridge.tensors.packed import PackedTensor

__all__ = ["InternVL"]


class InternVL(ModelFamily):
    """InternVL in transformers' format."""

    name: ClassVar[str] = "internvl"
    model_types: ClassVar[frozenset[str]] = frozenset({"internvl"})
    processor_classes: ClassVar[frozenset[str]] = frozenset({"InternVLProcessor"})
    end_of_turn: ClassVar[str | None] = "<|im_end|>"
    processor_only_keys: ClassVar[frozenset[str]] = frozenset({"num_patches"})

    def num_placeholders(
        self, modality: str, outputs: Mapping[str, torch.Tensor], processor: Any
    ) -> int | None:
        per_tile = getattr(processor, "image_seq_length", None)
        pixels = outputs.get("pixel_values")
        if modality != "image" or pixels is None or not isinstance(per_tile, int):
            return None
        return int(pixels.shape[0]) * per_tile

    def expected_placeholders(
        self, config: Any, modality: str, media: Mapping[str, PackedTensor]
    ) -> int | None:
        if modality != "image":
            return None
        return referenced_rows(media.get("pixel_values")) * int(config.image_seq_length)

    def expansion(self, processor: Any, modality: str, count: int) -> str | None:
        start, end = (
            getattr(processor, "start_image_token", None),
            getattr(processor, "end_image_token", None),
        )
        token = self.placeholder_text(processor, modality)
        if modality != "image" or not (
            isinstance(start, str) and isinstance(end, str) and isinstance(token, str)
        ):
            return None
        return f"{start}{token * count}{end}"

    def encoder_keys(self, modality: str) -> tuple[str, tuple[str, ...]] | None:
        return ("pixel_values", ()) if modality == "image" else None

    def vllm_prompt(
        self, prompt_token_ids: Sequence[int], media_counts: Mapping[str, int], config: Any, tokenizer: Any
    ) -> tuple[list[int], dict[str, int]]:
        if not media_counts.get("image"):
            return list(prompt_token_ids), {}
        context = int(config.image_token_id)
        start = int(tokenizer.convert_tokens_to_ids("<img>"))
        end = int(tokenizer.convert_tokens_to_ids("</img>"))
        ids = list(prompt_token_ids)
        out: list[int] = []
        found = 0
        i = 0
        while i < len(ids):
            if ids[i] == start and i + 1 < len(ids) and ids[i + 1] == context:
                stop = i + 1
                while stop < len(ids) and ids[stop] == context:
                    stop += 1
                if stop < len(ids) and ids[stop] == end:
                    out.append(context)
                    found += 1
                    i = stop + 1
                    continue
            out.append(ids[i])
            i += 1
        return out, {"image": found}
