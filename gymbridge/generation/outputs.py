"""Generated tokens -> wire shapes: Responses API output items and Chat Completions messages.

Both shapes come from one :class:`~gymbridge.generation.chat.ParsedOutput`, so the
model server's two endpoints and the native rollout loop describe a generation the
same way. Invariants:

* Responses items are ordered reasoning, message, function calls; a generation that
  parses to nothing still yields one (empty) assistant message, so the token fields
  always have an item to sit on;
* the token fields (``prompt_token_ids``, ``generation_token_ids``,
  ``generation_log_probs``, plus ``policy_version`` when the generation has one) go on
  the **last** item of the call, and only there (genuine servers omit
  ``policy_version``; the protocol models pass it through as an extra key);
* a rendered prompt becomes a :class:`GenerationInput` only through the trajectory
  layer's ``build_generation_input`` (the refresh rule's one builder).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gymbridge.generation.chat import ParsedOutput
from gymbridge.generation.types import Generation
from gymbridge.trajectory.refresh import ConversationHistory, build_generation_input
from gymbridge.trajectory.types import GenerationInput

if TYPE_CHECKING:
    from gymbridge.media import MediaItem

__all__ = [
    "chat_message",
    "generation_input_from_prompt",
    "response_items",
    "token_fields",
]


def token_fields(prompt_token_ids: Sequence[int], gen: Generation) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "prompt_token_ids": list(prompt_token_ids),
        "generation_token_ids": list(gen.token_ids),
        "generation_log_probs": list(gen.logprobs),
    }
    if gen.policy_version is not None:
        fields["policy_version"] = gen.policy_version
    return fields


def response_items(
    parsed: ParsedOutput, gen: Generation, prompt_token_ids: Sequence[int]
) -> list[dict[str, Any]]:
    """Responses API output items for one model call, token fields on the last one."""
    items: list[dict[str, Any]] = []
    if parsed.reasoning:
        items.append(
            {
                "id": f"rs_{uuid.uuid4().hex}",
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": r} for r in parsed.reasoning],
                "status": "completed",
            }
        )
    if parsed.content or not (items or parsed.tool_calls):
        items.append(
            {
                "id": f"msg_{uuid.uuid4().hex}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": parsed.content, "annotations": []}],
            }
        )
    for tc in parsed.tool_calls:
        items.append(
            {
                "id": f"fc_{uuid.uuid4().hex}",
                "type": "function_call",
                "call_id": tc.call_id,
                "name": tc.name,
                "arguments": tc.arguments,
                "status": "completed",
            }
        )
    items[-1].update(token_fields(prompt_token_ids, gen))
    return items


def chat_message(parsed: ParsedOutput, *, reasoning_field: bool = True) -> dict[str, Any]:
    """The assistant ``message`` of a Chat Completions choice (vLLM's shape).

    With ``reasoning_field`` (a server started with a reasoning parser) reasoning goes
    under ``reasoning_content`` and ``reasoning``; otherwise it stays in ``content``
    inside ``<think>`` tags.
    """
    content = parsed.content
    msg: dict[str, Any] = {"role": "assistant"}
    if parsed.reasoning and reasoning_field:
        joined = "".join(parsed.reasoning)
        msg["reasoning_content"] = joined
        msg["reasoning"] = joined
    elif parsed.reasoning:
        content = "".join(f"<think>{r}</think>" for r in parsed.reasoning) + content
    msg["content"] = content if (content or not parsed.tool_calls) else None
    msg["tool_calls"] = [
        {"id": tc.call_id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
        for tc in parsed.tool_calls
    ]
    return msg


def generation_input_from_prompt(
    prompt_token_ids: Sequence[int], media: Sequence[MediaItem]
) -> GenerationInput:
    """The :class:`GenerationInput` for a rendered prompt, built by ``build_generation_input``."""
    history = ConversationHistory()
    history.append(prompt_token_ids, media)
    return build_generation_input(history)
