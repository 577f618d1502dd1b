"""Responses-API items: what ``responses_create_params.input`` and ``response.output`` hold.

Modelled item types (``type``):

* ``message``: dispatched on ``role``. :class:`InputMessage` (``user`` /
  ``system`` / ``developer``: prompts and injected observations) and
  :class:`AssistantMessage` (``assistant``). ``content`` is a string
  (EasyInputMessage style) or a list of :data:`ContentPart`. ``type`` may be absent
  on input (``{"role": "user", "content": "hi"}``); it stays absent on dump;
* ``reasoning``: ``summary: [{"type": "summary_text", "text"}]``;
* ``function_call``: ``call_id``, ``name``, ``arguments`` (a JSON **string**);
* ``function_call_output``: ``call_id``, ``output`` (a string or a list of parts).

Anything else is an :class:`UnknownItem`, kept verbatim. Messages, reasoning and
function calls carry the optional token fields (:class:`TokenFields`); unknown items
are checked for them too (Gym lets any item carry them), never silently ignored.

The same union serves input and output: Gym agents put input-style items
(injected user messages, tool outputs without ids) into ``response.output``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from gymbridge.protocol._base import TokenFields, WireModel
from gymbridge.protocol._content import (
    ContentPart,
    InputAudioPart,
    InputImagePart,
    InputTextPart,
    InputVideoPart,
    OutputTextPart,
    ReasoningTextPart,
    SummaryTextPart,
    reject_known_type,
)

__all__ = [
    "KNOWN_ITEM_TYPES",
    "AssistantMessage",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "InputItem",
    "InputMessage",
    "Item",
    "Message",
    "OutputItem",
    "ReasoningItem",
    "UnknownItem",
    "iter_media_parts",
]

KNOWN_ITEM_TYPES: frozenset[str] = frozenset(
    {"message", "reasoning", "function_call", "function_call_output"}
)

Status = Literal["in_progress", "completed", "incomplete"]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _msg_id() -> str:
    return _new_id("msg")


def _rs_id() -> str:
    return _new_id("rs")


def iter_media_parts(
    content: str | list[ContentPart],
) -> Iterator[InputImagePart | InputAudioPart | InputVideoPart]:
    """The media parts of a ``content`` value, in order (none for a plain string)."""
    if isinstance(content, str):
        return
    for part in content:
        if isinstance(part, InputImagePart | InputAudioPart | InputVideoPart):
            yield part


def _text_of(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(
        part.text
        for part in content
        if isinstance(part, InputTextPart | OutputTextPart | SummaryTextPart | ReasoningTextPart)
    )


class InputMessage(TokenFields):
    """A ``user`` / ``system`` / ``developer`` message (prompt or injected observation)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer"]
    content: str | list[ContentPart]
    status: Status | None = None
    _emit_fields = ("type",)

    @property
    def text(self) -> str:
        """The concatenated text of the message."""
        return _text_of(self.content)


class AssistantMessage(TokenFields):
    """An ``assistant`` message: ``content: [{"type": "output_text", "text", "annotations"}]``.

    Built in Python it gets an ``id`` (``msg_…``) and ``status: "completed"``, as Gym's
    output message requires.
    """

    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: str | list[ContentPart]
    id: str | None = None
    status: Status | None = None
    _emit_fields = ("type", "role", "status")
    _emit_factories: ClassVar[Mapping[str, Callable[[], Any]]] = {"id": _msg_id}

    def _check_output(self) -> None:
        if self.status is None:
            self.status = "completed"

    @property
    def text(self) -> str:
        """The concatenated ``output_text`` of the message."""
        return _text_of(self.content)


#: A ``message`` item, dispatched on ``role``.
Message = Annotated[InputMessage | AssistantMessage, Field(discriminator="role")]


class ReasoningItem(TokenFields):
    """``{"type": "reasoning", "id", "summary": [{"type": "summary_text", "text"}]}``."""

    type: Literal["reasoning"] = "reasoning"
    id: str | None = None
    summary: list[ContentPart] = Field(default_factory=list)
    content: list[ContentPart] | None = None
    encrypted_content: str | None = None
    _emit_fields = ("type", "summary")
    _emit_factories: ClassVar[Mapping[str, Callable[[], Any]]] = {"id": _rs_id}

    @property
    def text(self) -> str:
        """The concatenated summary text."""
        return _text_of(self.summary)


class FunctionCallItem(TokenFields):
    """``{"type": "function_call", "call_id", "name", "arguments": "<JSON string>"}``."""

    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Status | None = None
    _emit_fields = ("type",)


class FunctionCallOutputItem(WireModel):
    """``{"type": "function_call_output", "call_id", "output"}``; ``output`` is text or parts."""

    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: Status | None = None
    _emit_fields = ("type",)


class UnknownItem(TokenFields):
    """Any other item type (``mcp_call``, ``web_search_call`` …): every key kept verbatim."""

    type: Annotated[str, reject_known_type(KNOWN_ITEM_TYPES, "item")]


KnownItem = Annotated[
    Message | ReasoningItem | FunctionCallItem | FunctionCallOutputItem,
    Field(discriminator="type"),
]

#: One Responses-API item. Dispatch runs in Rust: on ``type`` (then ``role`` for
#: messages); an item without ``type`` must be a message; other types are unknown items.
Item = Annotated[KnownItem | Message | UnknownItem, Field(union_mode="left_to_right")]
InputItem = Item
OutputItem = Item
