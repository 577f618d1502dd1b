"""Helpers shared by the generation and rollout tests: media, an independent teacher-forced reference."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from gymbridge.generation.types import SamplingConfig
from gymbridge.media import encode_data_url
from gymbridge.trajectory.types import Trajectory


def png_data_url(color: tuple[int, int, int] = (255, 0, 0), size: tuple[int, int] = (64, 48)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return encode_data_url(buf.getvalue(), "image/png")


def media_token_ids(tiny: Any) -> list[int]:
    """The tiny model's media placeholder and vision boundary ids (never sampled by the generator)."""
    return [tiny.image_token_id, tiny.video_token_id, tiny.vision_start_token_id, tiny.vision_end_token_id]


def reference_logprobs(
    tiny: Any,
    token_ids: Sequence[int],
    images: Sequence[Any],
    sampling: SamplingConfig,
    *,
    mask_media_tokens: bool = True,
) -> list[float]:
    """Teacher-forced ``[L]`` log-probabilities of ``token_ids[1:]`` (0.0 at position 0).

    Independent of ``HFGenerator``: one plain forward pass of the tiny model over the
    whole sequence with all its images, then (by hand) the media-token mask the generator
    samples under (``mask_media_tokens``), temperature and top-p.
    """
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        feats = tiny.processor.image_processor(images=list(images), return_tensors="pt")
        kwargs["pixel_values"] = feats["pixel_values"]
        kwargs["image_grid_thw"] = feats["image_grid_thw"]
        kwargs["mm_token_type_ids"] = (ids == tiny.image_token_id).to(torch.int32)
    with torch.no_grad():
        logits = tiny.model(**kwargs).logits[0].double()
    if mask_media_tokens:
        logits[:, media_token_ids(tiny)] = float("-inf")
    if sampling.temperature > 0:
        logits = logits / sampling.temperature
        if sampling.top_p < 1.0:
            probs = torch.softmax(logits, dim=-1)
            sorted_p, order = torch.sort(probs, dim=-1, descending=False)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop_sorted = cum <= (1 - sampling.top_p)
            drop_sorted[..., -1] = False
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
    lp = torch.log_softmax(logits, dim=-1)
    out = [0.0]
    for pos in range(1, len(token_ids)):
        out.append(float(lp[pos - 1, token_ids[pos]]))
    return out


def max_logprob_diff(tiny: Any, traj: Trajectory, sampling: SamplingConfig, segment: int = 0) -> float:
    """Max |generator logprob - teacher-forced logprob| over a segment's generated tokens."""
    tokens = traj.token_ids(segment)
    images = [m.image() for m in traj.media(segment) if m.modality == "image"]
    ref = reference_logprobs(tiny, tokens, images, sampling)
    got = traj.logprobs(segment)
    mask = traj.loss_mask(segment)
    diffs = [abs(g - r) for g, r, m in zip(got, ref, mask, strict=True) if m]
    assert diffs, "the segment has no generated tokens"
    return max(diffs)


# A Qwen3.5-style chat template for the tiny Qwen tokenizer: tool calls in the XML form
# (<tool_call><function=NAME><parameter=P>VALUE</parameter></function></tool_call>, values written
# as the Qwen3.5 templates write them: strings as they are, arrays / objects as JSON, other scalars
# through Jinja's ``string``), the tools listed as JSON in the system turn. Written for the tests.
_XML_TOOLS_RAW_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "To call a function, reply in this form:\n<tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{% if not loop.first %}\n{% elif message['content'] %}\n\n{% endif %}"
    "<tool_call>\n<function={{ call['name'] }}>\n"
    "{% if call['arguments'] is mapping %}{% for name, value in call['arguments'] | items %}"
    "<parameter={{ name }}>\n"
    "{% if value is mapping or (value is sequence and value is not string) %}{{ value | tojson }}"
    "{% else %}{{ value | string }}{% endif %}"
    "\n</parameter>\n{% endfor %}{% endif %}"
    "</function>\n</tool_call>"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
XML_TOOLS_CHAT_TEMPLATE = _XML_TOOLS_RAW_TEMPLATE.replace("%}\n", "%}{{ '\\n' }}")
"""The XML-tools template (transformers renders with ``trim_blocks``: a newline after a tag is spelt out)."""


def xml_tools_generator(tiny: Any) -> Any:
    """An ``HFGenerator`` over the tiny Qwen2-VL whose chat template writes XML tool calls (qwen3_coder)."""
    from gymbridge.generation.hf import HFGenerator

    return HFGenerator(
        tiny.model, tiny.processor, chat_template=XML_TOOLS_CHAT_TEMPLATE, model_name="tiny-xml"
    )


def call_tokens(gen: Any, text: str) -> list[int]:
    """The tokens of ``text`` as a generation of ``gen`` (its codec's tokenizer) ended by end-of-turn."""
    ids = gen.codec.tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids] + [gen.codec.end_of_turn_id]
