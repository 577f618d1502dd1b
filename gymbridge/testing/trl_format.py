"""The tiny Qwen2-VL as TRL 1.16 sees it, and a supervised *format* warm-up for TRL's tool loop.

A random-weight model never writes a tool call, so TRL's ``environment_factory`` path would only
ever train answers. :func:`warm_up` teaches the tiny model the format first, with supervised AdamW
steps over examples rendered exactly as TRL renders them: :func:`encode` (a prompt as
``processing_class.apply_chat_template`` renders it with the environment's tool methods, then a
target) and :func:`encode_after_tool` (the next model call after a tool answer, its tokens appended
as TRL's tool loop appends them). It trains until the format is learned, checked teacher-forced on
the examples themselves, and raises :class:`~gymbridge.errors.TrainingError` naming what was not
learned when its step cap is reached: the format holds by that check, not by a step count that
happened to suffice on one machine's float kernels.

Invariant: the warm-up teaches the format, never the answer. Examples that differ only in their
target (either colour word after the same tool image) are alternatives; the check requires each
to keep at least half its even share, and a caller that gives every image every word makes the
even split the loss's optimum, so the choice is left near chance.

Used by the TRL adapter tests (``tests/integrations/test_trl_train.py``,
``tests/gym/test_trl_genuine_agent.py``) and by ``examples/train_trl.py``. Needs
``gymbridge[trl]``; nothing is downloaded.
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
    "WarmUp",
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


@dataclass(frozen=True)
class WarmUp:
    """What :func:`warm_up` took: ``steps`` AdamW steps, the last one's mean ``loss``."""

    steps: int
    loss: float


def warm_up(
    tiny: TinyForTRL,
    examples: Sequence[dict[str, Any]],
    *,
    lr: float = 5e-3,
    min_prob: float = 0.9,
    max_steps: int = 500,
) -> WarmUp:
    """Train on ``examples`` (one AdamW step over all of them per step) until the format is learned.

    ``examples`` are :func:`encode` / :func:`encode_after_tool` batches (``[1, L]``). Learned means,
    teacher-forced on every example: the product over its target positions of the probability on
    the tokens the examples allow there is at least ``min_prob`` (a temperature-1 sample follows
    the format with at least that probability), and where examples with the same tokens so far
    allow several (alternatives, images aside: either colour word after one tool answer) each
    holds at least half its even share of ``min_prob``. Checked on each step's own forward, before
    its update (the tiny model has no dropout), so the model returned is the one that passed.
    Raises :class:`~gymbridge.errors.TrainingError` naming each example, target token and
    probability not learned when ``max_steps`` updates did not do it.
    """
    from gymbridge.errors import TrainingError

    allowed = _allowed_tokens(examples)
    optimizer = torch.optim.AdamW(tiny.model.parameters(), lr=lr)
    misses: list[str] = []
    loss_value = float("nan")
    for step in range(max_steps + 1):
        optimizer.zero_grad()
        misses, total = [], 0.0
        for index, batch in enumerate(examples):
            out = tiny.model(**batch)
            loss = out.loss / len(examples)
            if step < max_steps:
                loss.backward()
            total += float(loss.detach())
            miss = _miss(tiny, batch, out.logits.detach(), allowed, min_prob)
            if miss is not None:
                misses.append(f"example {index}: {miss}")
        loss_value = total
        if not misses:
            optimizer.zero_grad(set_to_none=True)
            return WarmUp(steps=step, loss=loss_value)
        if step < max_steps:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    raise TrainingError(
        f"format warm-up: not learned in {max_steps} steps (lr {lr}, min_prob {min_prob}, "
        f"loss {loss_value:.3f}): " + "; ".join(misses)
    )


def _allowed_tokens(examples: Sequence[dict[str, Any]]) -> dict[tuple[int, ...], set[int]]:
    """The target tokens the examples allow after each token prefix (images aside)."""
    allowed: dict[tuple[int, ...], set[int]] = {}
    for batch in examples:
        ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
        for pos, label in enumerate(labels):
            if label != -100:
                allowed.setdefault(tuple(ids[:pos]), set()).add(label)
    return allowed


def _miss(
    tiny: TinyForTRL,
    batch: dict[str, Any],
    logits: torch.Tensor,
    allowed: dict[tuple[int, ...], set[int]],
    min_prob: float,
) -> str | None:
    """Why ``batch`` (logits ``[1, L, V]``) fails :func:`warm_up`'s check, or ``None`` when it passes."""
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    first_target = next(pos for pos, label in enumerate(labels) if label != -100)
    on_path = 1.0
    weakest: tuple[float, int, list[int], torch.Tensor] | None = None
    for pos in range(first_target, len(ids)):
        tokens = sorted(allowed[tuple(ids[:pos])])
        probs = torch.softmax(logits[0, pos - 1].float(), dim=-1)[tokens]
        mass = float(probs.sum())
        floor = min_prob / (2 * len(tokens))
        if len(tokens) > 1 and float(probs.min()) < floor:
            where = _shares(tiny, pos - first_target, tokens, probs)
            return f"{where}: an alternative under {floor:.3f}"
        on_path *= mass
        if weakest is None or mass < weakest[0]:
            weakest = (mass, pos - first_target, tokens, probs)
    if on_path < min_prob and weakest is not None:
        return f"p(target) {on_path:.3f} < {min_prob}, weakest at {_shares(tiny, *weakest[1:])}"
    return None


def _shares(tiny: TinyForTRL, index: int, tokens: list[int], probs: torch.Tensor) -> str:
    names = [tiny.processing_class.tokenizer.decode([t]) for t in tokens]
    shares = ", ".join(f"{n!r} {float(p):.3f}" for n, p in zip(names, probs, strict=True))
    return f"target token {index} ({shares})"


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Train on one torch thread (spinning torch threads slow the TRL tests on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
