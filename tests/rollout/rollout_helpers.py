"""Helpers for the native-rollout tests."""

from __future__ import annotations

import json

from gymbridge.generation.hf import HFGenerator


def zoom_call_tokens(gen: HFGenerator, bbox: list[int]) -> list[int]:
    """The tokens of a well-formed Hermes zoom call, ended by the end-of-turn token."""
    text = "<tool_call>\n" + json.dumps({"name": "zoom", "arguments": {"bbox": bbox}}) + "\n</tool_call>"
    ids = gen.tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids] + [gen.codec.end_of_turn_id]
