"""``responses_create_params`` (the request) and the Responses-API ``response`` object.

:class:`ResponsesCreateParams` mirrors what NeMo Gym 0.7.0 accepts in
``NeMoGymResponseCreateParamsNonStreaming``. Gym validates that object with
**extra keys forbidden** (HTTP 422), so:

* parsed from the wire, unknown keys are kept (lenient) and listed by
  :attr:`ResponsesCreateParams.non_gym_keys`;
* built in Python, an unknown key is refused with a ``ValueError`` naming it (put
  gymbridge's own keys at the row's top level instead).

:class:`Response` mirrors Gym's ``NeMoGymResponse`` (OpenAI ``Response``): built in
Python it gets ``id``, ``created_at``, ``object``, ``parallel_tool_calls``,
``tool_choice`` and ``tools`` written, and ``model`` is required.

``Response.output`` is normally a flat list of items. Agents run with
``return_transitions: true`` (stock ``aviary_agent``, ``toolsandbox_agent``) return
it as a list of **transitions** instead: one list of items per step, each the
agent's whole input at that step (so each transition extends the one before) and
mark the response ``contains_transitions: true``. Both forms parse and write back
unchanged; :attr:`Response.items` gives the flat conversation either way.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import Field

from gymbridge.protocol._base import WireModel
from gymbridge.protocol._content import reject_known_type
from gymbridge.protocol._items import AssistantMessage, FunctionCallItem, InputMessage, Item, ReasoningItem

__all__ = ["FunctionTool", "Response", "ResponseOutput", "ResponsesCreateParams", "Tool", "UnknownTool"]


class FunctionTool(WireModel):
    """``{"type": "function", "name", "parameters": {JSON schema}, "strict", "description"}``."""

    type: Literal["function"] = "function"
    name: str
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None
    _emit_fields = ("type", "parameters", "strict")


class UnknownTool(WireModel):
    """Any other tool type (``web_search``, ``mcp`` …), kept verbatim."""

    type: Annotated[str, reject_known_type(frozenset({"function"}), "tool")]


Tool = Annotated[FunctionTool | UnknownTool, Field(union_mode="left_to_right")]


class ResponsesCreateParams(WireModel):
    """The body of ``POST /v1/responses`` and a dataset row's ``responses_create_params``."""

    input: str | list[Item]
    tools: list[Tool] = Field(default_factory=list)
    model: str | None = None
    instructions: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    tool_choice: str | dict[str, Any] | None = "auto"
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    store: bool | None = None
    stream: Literal[False] | None = None
    background: bool | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None
    service_tier: str | None = None
    context_management: list[Any] | None = None
    conversation: str | dict[str, Any] | None = None
    moderation: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None

    def _check_output(self) -> None:
        extra = self.non_gym_keys
        if extra:
            raise ValueError(
                f"responses_create_params does not accept {', '.join(map(repr, extra))}: NeMo Gym 0.7.0 "
                "forbids extra keys there (HTTP 422); put them at the row's top level"
            )

    @property
    def non_gym_keys(self) -> list[str]:
        """Keys NeMo Gym would refuse with HTTP 422 (kept here because they came from the wire)."""
        return sorted(self.model_extra or {})

    @property
    def input_items(self) -> list[Item]:
        """``input`` as a list of items (a plain string becomes one user message, as Gym does)."""
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return list(self.input)


def _resp_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


#: ``response.output``: a flat item list, or (``contains_transitions``) one item list per step.
ResponseOutput = Annotated[list[Item] | list[list[Item]], Field(union_mode="left_to_right")]


class Response(WireModel):
    """A Responses-API response: ``output`` holds every item the call (or rollout) produced."""

    output: ResponseOutput
    id: str | None = None
    created_at: float | None = None
    model: str | None = None
    object: Literal["response"] = "response"
    status: str | None = None
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    instructions: Any = None
    parallel_tool_calls: bool | None = True
    tool_choice: str | dict[str, Any] | None = "auto"
    tools: list[Tool] = Field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    _emit_fields = ("object", "parallel_tool_calls", "tool_choice", "tools")
    _emit_factories: ClassVar[Mapping[str, Callable[[], Any]]] = {"id": _resp_id, "created_at": time.time}

    def _check_output(self) -> None:
        if self.model is None:
            raise ValueError("Response.model is required for a response gymbridge emits")

    @property
    def is_transitions(self) -> bool:
        """True when ``output`` is a list of transitions (one item list per agent step)."""
        return bool(self.output) and isinstance(self.output[0], list)

    @property
    def items(self) -> list[Item]:
        """The flat conversation: ``output`` itself, or its last transition (which extends the others)."""
        if not self.output:
            return []
        last = self.output[-1]
        if isinstance(last, list):
            return list(last)
        return cast("list[Item]", list(self.output))

    @property
    def output_text(self) -> str:
        """The concatenated text of the assistant messages in :attr:`items`."""
        return "".join(item.text for item in self.items if isinstance(item, AssistantMessage))

    @property
    def incomplete(self) -> bool:
        """True when the agent stopped early (``status == "incomplete"`` or ``incomplete_details``)."""
        return self.status == "incomplete" or bool(self.incomplete_details)

    @property
    def generated_items(self) -> list[AssistantMessage | ReasoningItem | FunctionCallItem]:
        """The output items a model generated (assistant messages, reasoning, function calls)."""
        generated = AssistantMessage | ReasoningItem | FunctionCallItem
        return [item for item in self.items if isinstance(item, generated)]
