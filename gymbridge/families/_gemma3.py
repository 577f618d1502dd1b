"""Gemma 3: fixed-size image tokens, bidirectional attention over each image, sliding-window layers.

* The template writes ``<start_of_image>`` per image; ``Gemma3Processor`` replaces it with
  ``\\n\\n<start_of_image>`` + ``<image_soft_token>`` x ``mm_tokens_per_image`` + ``<end_of_image>\\n\\n``
  (pan-and-scan off: one block per image). The model scatters features into the soft tokens
  (``config.image_token_id``), not into ``<start_of_image>`` (the processor's ``image_token_id``).
* An item's count is its ``pixel_values`` rows (1, plus pan-and-scan crops) times
  ``image_seq_length``; ``num_crops`` only sizes the text and never reaches the model.
* The forward takes ``token_type_ids`` (1 on soft tokens): the image's tokens attend to each other
  in both directions (causal elsewhere); generation's prefill and the trainer pass the same.
* Positions are 1-D. Packed rows need the family's own masks: per layer type, block-diagonal,
  causal or bidirectional within an image block, and the sliding window on ``sliding_attention``
  layers (``kv > q - sliding_window``), which is what the model builds for one padded row.
* The encoder is ``get_image_features(pixel_values)``: one ``[tokens, hidden]`` block per image row.
* vLLM's Gemma 3 processor replaces ``<start_of_image>`` with the whole sequence above, so the
  vLLM prompt cuts each image's block (its ``\\n\\n`` tokens included) back to ``<start_of_image>``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from gymbridge.families._base import ModelFamily, referenced_rows

if TYPE_CHECKING:
    from gymbridge.tensors.packed import PackedTensor

__all__ = ["Gemma3"]


class Gemma3(ModelFamily):
    """Gemma 3 (``Gemma3ForConditionalGeneration``)."""

    name: ClassVar[str] = "gemma3"
    model_types: ClassVar[frozenset[str]] = frozenset({"gemma3"})
    processor_classes: ClassVar[frozenset[str]] = frozenset({"Gemma3Processor"})
    end_of_turn: ClassVar[str | None] = "<end_of_turn>"
    processor_only_keys: ClassVar[frozenset[str]] = frozenset({"num_crops"})
    positions: ClassVar[str] = "1-D (bidirectional within an image)"
    packs_own_masks: ClassVar[bool] = True

    def processor_placeholder_ids(self, processor: Any) -> dict[str, int]:
        tokenizer = getattr(processor, "tokenizer", None)
        tid = getattr(tokenizer, "image_token_id", None)
        return {"image": int(tid)} if isinstance(tid, int) else {}

    def num_placeholders(
        self, modality: str, outputs: Mapping[str, torch.Tensor], processor: Any
    ) -> int | None:
        per_image = getattr(processor, "image_seq_length", None)
        pixels = outputs.get("pixel_values")
        if modality != "image" or pixels is None or not isinstance(per_image, int):
            return None
        return int(pixels.shape[0]) * per_image

    def expected_placeholders(
        self, config: Any, modality: str, media: Mapping[str, PackedTensor]
    ) -> int | None:
        if modality != "image":
            return None
        return referenced_rows(media.get("pixel_values")) * int(config.mm_tokens_per_image)

    def placeholder_text(self, processor: Any, modality: str) -> str | None:
        boi = getattr(processor, "boi_token", None)
        return boi if modality == "image" and isinstance(boi, str) else None

    def expansion(self, processor: Any, modality: str, count: int) -> str | None:
        tokenizer = getattr(processor, "tokenizer", None)
        boi = self.placeholder_text(processor, modality)
        soft, eoi = getattr(tokenizer, "image_token", None), getattr(tokenizer, "eoi_token", None)
        if count != getattr(processor, "image_seq_length", None):
            return None  # pan-and-scan crops: the processor writes their text
        if not (isinstance(boi, str) and isinstance(soft, str) and isinstance(eoi, str)):
            return None
        return f"\n\n{boi}{soft * count}{eoi}\n\n"

    def token_type_kwargs(
        self, config: Any, input_ids: torch.Tensor, present: Iterable[str], forward_params: Iterable[str]
    ) -> dict[str, torch.Tensor]:
        if "image" not in set(present) or "token_type_ids" not in set(forward_params):
            return {}
        return {"token_type_ids": (input_ids == int(config.image_token_id)).to(torch.int64)}

    def encoder_keys(self, modality: str) -> tuple[str, tuple[str, ...]] | None:
        return ("pixel_values", ()) if modality == "image" else None

    def packed_attention_mask(self, model: Any, rows: Any, packed: Mapping[str, Any]) -> Any | None:
        """``{"full_attention": [1, 1, S, S], "sliding_attention": [1, 1, S, S]}`` (module docstring)."""
        text = model.config.get_text_config()
        seq = rows.sequence_ids()  # [S]
        pos = torch.arange(seq.numel(), device=seq.device)
        same_row = seq[:, None] == seq[None, :]
        causal = pos[None, :] <= pos[:, None]
        ids = packed["input_ids"][0].to(seq.device)
        is_image = ids == int(model.config.image_token_id)
        starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:-1]
        block = torch.where(is_image, torch.cumsum(starts.to(torch.int64), 0) - 1, torch.full_like(pos, -1))
        same_image = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
        full = same_row & (causal | same_image)
        window = int(getattr(text, "sliding_window", 0) or 0)
        sliding = full & (pos[None, :] > pos[:, None] - window) if window else full
        impl = str(getattr(text, "_attn_implementation", None) or "eager")
        masks = {"full_attention": full[None, None], "sliding_attention": sliding[None, None]}
        if impl == "eager":
            dtype = next(model.parameters()).dtype
            low = torch.finfo(dtype).min
            return {k: torch.zeros(m.shape, dtype=dtype).masked_fill(~m, low) for k, m in masks.items()}
        return masks

    def vllm_prompt(
        self, prompt_token_ids: Sequence[int], media_counts: Mapping[str, int], config: Any, tokenizer: Any
    ) -> tuple[list[int], dict[str, int]]:
        if not media_counts.get("image"):
            return list(prompt_token_ids), {}
        boi, eoi = int(config.boi_token_index), int(config.eoi_token_index)
        soft = int(config.image_token_id)
        newlines = [int(t) for t in tokenizer("\n\n", add_special_tokens=False)["input_ids"]]
        ids = list(prompt_token_ids)
        out: list[int] = []
        found = 0
        i = 0
        while i < len(ids):
            if ids[i] == boi and i + 1 < len(ids) and ids[i + 1] == soft:
                end = i + 1
                while end < len(ids) and ids[end] == soft:
                    end += 1
                if end < len(ids) and ids[end] == eoi:
                    n = len(newlines)
                    if n and out[-n:] == newlines:
                        del out[-n:]
                    out.append(boi)
                    found += 1
                    i = end + 1
                    if n and ids[i : i + n] == newlines:
                        i += n
                    continue
            out.append(ids[i])
            i += 1
        return out, {"image": found}
