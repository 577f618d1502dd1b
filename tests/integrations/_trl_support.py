"""Helpers of the TRL adapter tests: the tiny Qwen2-VL as TRL sees it, a format warm-up, a spying trainer.

A random-weight model never writes a tool call, so the TRL tests first teach it the *format*
with a few supervised steps (:func:`warm_up` over :func:`encode` d examples), rendered exactly as
TRL 1.16 renders prompts (``processing_class.apply_chat_template`` with the environment's tool
methods, and a tool answer's tokens as its tool loop appends them): the ``look`` call, and after
a look result showing a colour the task never asks about, each answer word once (so the answer
is independent of the image and the reward still has to be learned from the environment).
:func:`spying_trainer` builds a real ``GRPOTrainer`` whose training forwards record how many
images they carried.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

LOOK_CALL = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>'


@dataclass
class TinyForTRL:
    model: Any
    """A deep copy of the tiny Qwen2-VL (seed 0), trainable."""
    processing_class: Any
    """``tiny_hf_processor``: a transformers ``ProcessorMixin`` (TRL's VLM switch)."""


def tiny_for_trl() -> TinyForTRL:
    from trl.chat_template_utils import qwen3_template

    from gymbridge.testing.tiny_vlm import build_tiny_vlm, tiny_hf_processor

    tiny = build_tiny_vlm(0)
    processing_class = tiny_hf_processor(copy.deepcopy(tiny.tokenizer))
    # the tiny template writes Hermes tool calls like Qwen3's: TRL parses them with Qwen3's response template
    processing_class.tokenizer.response_template = qwen3_template
    model = copy.deepcopy(tiny.model)
    model.train()
    return TinyForTRL(model=model, processing_class=processing_class)


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
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
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
    call (both follow ``<|im_start|>assistant``), so the tests end on a call-only phase.
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


@dataclass
class ForwardSpy:
    """Images carried by each training forward (``GRPOTrainer._get_per_token_logps_and_entropies``)."""

    images_per_forward: list[int] = field(default_factory=list)


def spying_trainer(spy: ForwardSpy, **kwargs: Any) -> Any:
    """A real ``GRPOTrainer`` whose per-token-logprob forwards record their ``image_grid_thw`` rows."""
    from trl import GRPOTrainer

    class SpyingGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **forward: Any) -> Any:
            grid = forward.get("image_grid_thw")
            spy.images_per_forward.append(0 if grid is None else int(grid.shape[0]))
            return super()._get_per_token_logps_and_entropies(model, *args, **forward)

    return SpyingGRPOTrainer(**kwargs)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Train on one torch thread: on a loaded machine two spinning threads ran these tests 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def vision_params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".visual." in f".{n}"}


def changed(before: dict[str, torch.Tensor], model: Any) -> list[str]:
    now = dict(model.named_parameters())
    return [n for n, p in before.items() if not torch.equal(p, now[n].detach())]
