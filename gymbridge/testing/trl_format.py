"""The tiny Qwen2-VL as TRL 1.16 sees it, and a supervised *format* warm-up for TRL's tool loop.

A random-weight model never writes a tool call, so TRL's ``environment_factory`` path would only
ever train answers. :func:`warm_up` teaches the tiny model the format first, with a few
supervised AdamW steps over examples rendered exactly as TRL renders them: :func:`encode` (a
prompt as ``processing_class.apply_chat_template`` renders it with the environment's tool
methods, then a target) and :func:`encode_after_tool` (the next model call after a tool answer,
its tokens appended as TRL's tool loop appends them). Used by the TRL adapter tests
(``tests/integrations/test_trl_train.py``, ``tests/gym/test_trl_genuine_agent.py``) and by
``examples/train_trl.py``. Needs ``gymbridge[trl]``; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "TinyForTRL",
    "encode",
    "encode_after_tool",
    "one_torch_thread",
    "tiny_for_trl",
    "tool_call",
    "warm_up",
]


@dataclass
class TinyForTRL:
    model: Any
    """A deep copy of the tiny Qwen2-VL (seed 0), trainable."""
    processing_class: Any
    """``tiny_hf_processor``: a transformers ``ProcessorMixin`` (TRL's VLM switch)."""


def tiny_for_trl() -> TinyForTRL:
    """The tiny Qwen2-VL, trainable, and a processor whose tool calls TRL parses (Qwen3's template)."""
    from trl.chat_template_utils import qwen3_template

    from gymbridge.testing.tiny_vlm import build_tiny_vlm, tiny_hf_processor

    tiny = build_tiny_vlm(0)
    processing_class = tiny_hf_processor(copy.deepcopy(tiny.tokenizer))
    # the tiny template writes Hermes tool calls like Qwen3's: TRL parses them with Qwen3's response template
    processing_class.tokenizer.response_template = qwen3_template
    model = copy.deepcopy(tiny.model)
    model.train()
    return TinyForTRL(model=model, processing_class=processing_class)


def tool_call(name: str, arguments: Mapping[str, Any] | None = None) -> str:
    """The tiny template's (Hermes) text of one tool call, as the model should write it."""
    body = json.dumps({"name": name, "arguments": dict(arguments or {})})
    return f"<tool_call>\n{body}\n</tool_call>"


def encode(
    processing_class: Any, messages: list[dict[str, Any]], tools: Sequence[Any] | None, target: str
) -> dict[str, Any]:
    """One supervised example: ``messages`` rendered as TRL renders a prompt, then ``target``, end of turn."""
    from trl.data_utils import prepare_multimodal_messages

    prompt = processing_class.apply_chat_template(
        [prepare_multimodal_messages(messages)], tools=list(tools) if tools else None,
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
    )  # fmt: skip
    target_ids = processing_class.tokenizer(
        target + "<|im_end|>", add_special_tokens=False, return_tensors="pt"
    )["input_ids"]
    input_ids = torch.cat([prompt["input_ids"], target_ids], dim=1)
    labels = torch.cat([torch.full_like(prompt["input_ids"], -100), target_ids], dim=1)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    for key in ("pixel_values", "image_grid_thw"):
        if key in prompt:
            batch[key] = prompt[key]
    if "mm_token_type_ids" in prompt:
        batch["mm_token_type_ids"] = torch.cat(
            [prompt["mm_token_type_ids"], torch.zeros_like(target_ids)], dim=1
        )
    return batch


def encode_after_tool(
    processing_class: Any, first: dict[str, Any], tool_message: dict[str, Any], target: str
) -> dict[str, Any]:
    """The second model call's example, its tokens built as TRL's tool loop builds them.

    ``first`` is :func:`encode` of the first call (its target: the call); TRL then appends the tool
    answer's tokens (``GRPOTrainer._get_tool_suffix_ids``: the template of a one-call conversation
    with and without the tool message, cut after the last end of turn) and generates again.
    """
    from trl.data_utils import prepare_multimodal_messages

    calls = [{"type": "function", "function": {"name": tool_message["name"], "arguments": {}}}]
    dummy: list[dict[str, Any]] = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": calls},
    ]
    prefix = processing_class.apply_chat_template(
        prepare_multimodal_messages(dummy), tokenize=True, return_dict=False
    )[0]  # fmt: skip
    full = processing_class.apply_chat_template(
        prepare_multimodal_messages([*dummy, tool_message]), add_generation_prompt=True, tokenize=True,
        return_dict=True, return_tensors="pt",
    )  # fmt: skip
    eos = processing_class.tokenizer.eos_token_id
    cut = max(i for i, t in enumerate(prefix) if t == eos) + 1
    suffix = full["input_ids"][:, cut:]
    target_ids = processing_class.tokenizer(
        target + "<|im_end|>", add_special_tokens=False, return_tensors="pt"
    )
    input_ids = torch.cat([first["input_ids"], suffix, target_ids["input_ids"]], dim=1)
    labels = torch.full_like(input_ids, -100)
    labels[:, -target_ids["input_ids"].shape[1] :] = target_ids["input_ids"]
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": labels,
        "pixel_values": full["pixel_values"],
        "image_grid_thw": full["image_grid_thw"],
        "mm_token_type_ids": (input_ids == processing_class.image_token_id).long(),
    }


def warm_up(
    tiny: TinyForTRL, phases: Sequence[tuple[Sequence[dict[str, Any]], int]], *, lr: float = 1e-2
) -> float:
    """Supervised phases ``[(encoded examples, steps)]``, one AdamW step over all examples per step.

    Returns the last step's mean loss. A phase of answers alone makes the 2-layer model forget the
    call (both follow ``<|im_start|>assistant``), so end on a call-only phase.
    """
    optimizer = torch.optim.AdamW(tiny.model.parameters(), lr=lr)
    loss_value = float("nan")
    for examples, steps in phases:
        for _ in range(steps):
            optimizer.zero_grad()
            total = 0.0
            for batch in examples:
                loss = tiny.model(**batch).loss / len(examples)
                loss.backward()
                total += float(loss.detach())
            optimizer.step()
            loss_value = total
    optimizer.zero_grad(set_to_none=True)
    return loss_value


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Train on one torch thread (spinning torch threads slow the TRL tests on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
