"""The I/O-free half of one rollout, shared by both loops that play rollouts.

:class:`~gymbridge.server.SimpleAgent` (the HTTP agent) and
:func:`gymbridge.rollout.run_episode` (the native loop) differ only in how they
reach the model and the environment; everything that turns an environment's
answer into conversation items lives here, once:

* :func:`input_items` — ``responses_create_params.input`` as a list of items;
* :func:`observation_message` — a ``/reset`` or ``/step`` observation as a user
  message (``observation_content`` parts preferred over the ``observation`` text);
* :func:`offered_tool_names` / :func:`tool_call_request` / :func:`tool_output_items` —
  the tools a row offers, a ``function_call`` item to the tool's (name, arguments)
  (only an offered tool, never a protocol route), and a tool's answer back to items
  (stock error bodies for non-JSON arguments and unknown names, the same kind of body for
  arguments nested too deep; media parts in a user message after the output by default);
* :class:`ToolEpisode` — the tool-style state machine: each model response
  either asks for tool calls or ends the episode (an answer; ``incomplete`` on
  ``incomplete_details``, reasoning-only or empty output, or ``max_steps``);
* :class:`GymnasiumEpisode` — the gymnasium-style state machine: the ``/reset``
  answer, each model response, each ``/step`` answer (tool outputs from
  ``info.tool_outputs`` then the observation), ``terminated`` / ``truncated``,
  whether to ``/close``, and the result in ``/run``'s shape.

Invariants: a malformed environment answer raises
:class:`~gymbridge.errors.ProtocolError` naming what is wrong (never a
``KeyError`` or ``AttributeError``, never an entry silently skipped); the items
produced are the same, in the same order, whichever loop asked.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

import orjson

from gymbridge.errors import ProtocolError
from gymbridge.limits import MAX_JSON_DEPTH, json_too_deep
from gymbridge.server._base import RESERVED_TOOL_NAMES

logger = logging.getLogger(__name__)

__all__ = [
    "GymnasiumEpisode",
    "StepAnswer",
    "ToolEpisode",
    "add_usage",
    "input_items",
    "observation_message",
    "offered_tool_names",
    "tool_call_request",
    "tool_output_items",
]

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
"""A tool name that may become a URL path segment."""


def input_items(value: Any) -> list[Any]:
    """``responses_create_params.input`` as a fresh list of items (a string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    raise ProtocolError(
        f"responses_create_params.input must be a string or a list, got {type(value).__name__}"
    )


def observation_message(data: Mapping[str, Any]) -> dict[str, Any] | None:
    """The user message for an observation: its content parts when given, else its text, else None."""
    content = data.get("observation_content")
    if isinstance(content, list) and content:
        return {"type": "message", "role": "user", "content": content}
    text = data.get("observation")
    if text:
        return {"type": "message", "role": "user", "content": str(text)}
    return None


def _output(call_id: Any, output: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def _too_deep_output(call_id: Any) -> dict[str, Any]:
    reason = f"nested deeper than {MAX_JSON_DEPTH} levels"
    return _output(call_id, json.dumps({"error": f"Invalid tool call arguments: {reason}"}))


def offered_tool_names(rcp: Mapping[str, Any]) -> frozenset[str]:
    """The function tools a row offers (``responses_create_params.tools``), less reserved routes.

    Responses-API tools (``{"type": "function", "name": ...}``) and chat-style ones
    (``{"type": "function", "function": {"name": ...}}``) both count; a protocol route
    (:data:`~gymbridge.server._base.RESERVED_TOOL_NAMES`) never does, even when a row lists it.
    """
    tools = rcp.get("tools")
    if not isinstance(tools, list):
        return frozenset()
    names: set[str] = set()
    for spec in tools:
        if not isinstance(spec, Mapping) or spec.get("type", "function") != "function":
            continue
        name = spec.get("name")
        if name is None and isinstance(spec.get("function"), Mapping):
            name = spec["function"].get("name")
        if isinstance(name, str) and TOOL_NAME.match(name) and name not in RESERVED_TOOL_NAMES:
            names.add(name)
    return frozenset(names)


def tool_call_request(
    call: Mapping[str, Any], offered: frozenset[str]
) -> tuple[str, Any] | list[dict[str, Any]]:
    """``(tool name, parsed arguments)`` to POST, or the items that answer the call without a request.

    Only a tool in ``offered`` (:func:`offered_tool_names` of the row) is ever posted: a
    model that names a protocol route (``seed_session``, ``verify``, ``close_session``,
    ...) or any tool the row did not offer gets ``{"detail": "Not Found"}`` back as the
    tool's output, what a stock server answers for an unknown tool. Stock Gym's other
    answers are kept: non-JSON arguments get ``{"error": "Invalid tool call arguments: ..."}``.
    Arguments nested deeper than :data:`~gymbridge.limits.MAX_JSON_DEPTH` (a model may emit
    any text) get the same kind of error and are never posted: no body gymbridge sends or
    accepts nests deeper, and writing one would fail inside the agent.
    """
    call_id = call.get("call_id")
    name = str(call.get("name", ""))
    try:
        arguments = json.loads(call.get("arguments") or "")
    except RecursionError:  # the stdlib parser recurses: thousands of levels exhaust the stack
        return [_too_deep_output(call_id)]
    except (ValueError, TypeError) as exc:
        return [_output(call_id, json.dumps({"error": f"Invalid tool call arguments: {exc!r}"}))]
    if json_too_deep(arguments):
        return [_too_deep_output(call_id)]
    if name not in offered:
        if name in RESERVED_TOOL_NAMES:
            logger.warning("refused a model call to the protocol route %r as a tool", name)
        return [_output(call_id, json.dumps({"detail": "Not Found"}))]
    return name, arguments


def _tool_parts(body: bytes | str, parts_header: str | None) -> list[dict[str, Any]] | None:
    if parts_header != "parts":
        return None
    try:
        parts = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(parts, list) and all(isinstance(p, dict) and "type" in p for p in parts):
        return parts
    return None


def tool_output_items(
    call_id: Any, body: bytes | str, parts_header: str | None, tool_media: str
) -> list[dict[str, Any]]:
    """The items a tool's answer adds (the body text verbatim, error bodies included).

    A body marked ``X-Gymbridge-Tool-Output: parts`` holds content parts: the
    text parts joined become the output, and the media go in a ``user`` message
    right after it (``tool_media="output"``: all parts stay in the output).
    """
    parts = _tool_parts(body, parts_header)
    if parts is None:
        text = body if isinstance(body, str) else body.decode("utf-8", errors="replace")
        return [_output(call_id, text)]
    text = "\n".join(str(p.get("text", "")) for p in parts if p.get("type") == "input_text")
    media = [p for p in parts if p.get("type") != "input_text"]
    if tool_media == "output" or not media:
        return [_output(call_id, parts if media else text)]
    return [_output(call_id, text), {"type": "message", "role": "user", "content": media}]


def add_usage(total: dict[str, Any] | None, usage: Any) -> dict[str, Any] | None:
    """Token usage summed over model calls (``input/output/total_tokens``; other keys from the first)."""
    if not isinstance(usage, dict):
        return total
    if total is None:
        return dict(usage)
    out = dict(total)
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        a, b = out.get(key), usage.get(key)
        if isinstance(a, int) and isinstance(b, int):
            out[key] = a + b
    return out


def _with_termination_reason(response: dict[str, Any], reason: str) -> None:
    """Set ``metadata.ng_termination_reason`` (stock simple_agent's field), keeping other metadata."""
    metadata = response.get("metadata")
    kept = metadata if isinstance(metadata, dict) else {}
    response["metadata"] = {**kept, "ng_termination_reason": reason}


class _Conversation:
    """What both episode styles keep: the initial input, every item since, the summed usage."""

    def __init__(self, base_input: list[Any]) -> None:
        self.base_input = base_input
        self.outputs: list[Any] = []
        self.usage: dict[str, Any] | None = None
        self.last_response: dict[str, Any] = {}

    def model_input(self) -> list[Any]:
        """The next model call's input: the initial input, then every item so far."""
        return self.base_input + self.outputs

    def _record(self, response: dict[str, Any]) -> list[Any]:
        """Record one model response (its items join the conversation); returns its output list."""
        output = response.get("output")
        if not isinstance(output, list):
            raise ProtocolError("the model response has no output list")
        self.last_response = response
        self.outputs.extend(output)
        self.usage = add_usage(self.usage, response.get("usage"))
        return output


# ------------------------------------------------------------------ tool style
class ToolEpisode(_Conversation):
    """One tool-style rollout's conversation: model -> tool calls -> model ... -> the response.

    The caller does the I/O::

        episode = ToolEpisode(rcp)
        for step in range(1, max_steps + 1):
            calls = episode.add_response(<model call on episode.model_input()>)
            if calls is None:
                break
            for call in calls:
                episode.outputs.extend(<the tool's items>)
            if step >= max_steps:
                episode.stop_at_max_steps()
        return episode.response()
    """

    def __init__(self, rcp: Mapping[str, Any]) -> None:
        super().__init__(input_items(rcp.get("input")))
        self.status = "completed"

    def add_response(self, response: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Record one model response; the function calls to run, or None when the episode ends.

        Stock simple_agent's rules: ``incomplete_details`` ends it incomplete; no
        call and no assistant message (reasoning only, or nothing) ends it incomplete
        with ``metadata.ng_termination_reason``; no call but a message is the answer.
        """
        output = self._record(response)
        if response.get("incomplete_details"):
            self.status = "incomplete"
            return None
        items = [o for o in output if isinstance(o, dict)]
        calls = [o for o in items if o.get("type") == "function_call"]
        if calls:
            return calls
        if not any(o.get("type") == "message" and o.get("role") == "assistant" for o in items):
            self.status = "incomplete"
            _with_termination_reason(response, "incomplete_reasoning" if output else "empty_output")
        return None

    def stop_at_max_steps(self) -> None:
        """The step budget ran out with tool calls still being made."""
        self.status = "incomplete"

    def response(self) -> dict[str, Any]:
        """The rollout's Responses object: the last call's fields, every item of every turn, summed usage."""
        return {**self.last_response, "output": self.outputs, "usage": self.usage, "status": self.status}


# ------------------------------------------------------------------ gymnasium
def _flag(data: Mapping[str, Any], key: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise ProtocolError(f"/step answered {key}={value!r}; expected true or false")
    return value


def _info(data: Mapping[str, Any], what: str) -> dict[str, Any]:
    info = data.get("info")
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise ProtocolError(f"{what} answered info of type {type(info).__name__}; expected an object")
    return info


class StepAnswer:
    """One validated ``/step`` answer."""

    __slots__ = ("info", "items", "reward", "terminated", "truncated")

    def __init__(self, data: Any) -> None:
        if not isinstance(data, dict):
            raise ProtocolError(f"/step answered a {type(data).__name__}; expected an object")
        reward = data.get("reward", 0.0)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ProtocolError(f"/step answered reward={reward!r}; expected a finite number")
        self.reward = float(reward)
        self.terminated = _flag(data, "terminated")
        self.truncated = _flag(data, "truncated")
        self.info = _info(data, "/step")
        self.items: list[dict[str, Any]] = []
        """What the episode adds to the conversation when it goes on: tool outputs, then the observation."""
        tool_outputs = self.info.get("tool_outputs")
        if tool_outputs is not None and not isinstance(tool_outputs, list):
            raise ProtocolError(
                f"/step info.tool_outputs is a {type(tool_outputs).__name__}; expected a list"
            )
        for i, entry in enumerate(tool_outputs or []):
            if not isinstance(entry, dict) or "call_id" not in entry or "output" not in entry:
                raise ProtocolError(
                    f"/step info.tool_outputs[{i}] must be an object with call_id and output; "
                    f"got {str(entry)[:200]}"
                )
            self.items.append(_output(entry["call_id"], entry["output"]))
        message = observation_message(data)
        if message is not None:
            self.items.append(message)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


class GymnasiumEpisode(_Conversation):
    """One gymnasium-style rollout's conversation: ``/reset`` -> (model -> ``/step``)* -> result.

    The caller does the I/O::

        episode = GymnasiumEpisode(row)           # row checked before any call
        episode.start(<POST /reset with the row>)
        try:
            for _ in range(max_steps):
                response = <model call on episode.model_input()>
                body = episode.add_response(response)
                if episode.context_exhausted:
                    break                             # nothing to step with; later calls only grow
                step = <POST /step with body>
                if episode.add_step(step).done:
                    break
        finally:
            if episode.supports_close: <POST /close>
        return episode.result()
    """

    def __init__(self, row: Mapping[str, Any]) -> None:
        """Check the row (a bad one raises ``ProtocolError`` before any environment call)."""
        rcp = row.get("responses_create_params")
        if not isinstance(rcp, Mapping):
            raise ProtocolError("the row has no responses_create_params object")
        self.row = dict(row)
        super().__init__(input_items(rcp.get("input")))
        self.rcp = {**rcp, "input": self.base_input}  # the same list: the reset observation joins it
        self.supports_close = False
        self.total_reward = 0.0
        self.last_step: StepAnswer | None = None
        self.context_exhausted = False
        """The model produced nothing and said why (e.g. the prompt filled the context): stop.

        Stepping with an empty action would only grow the conversation, so every later
        model call would end the same way until ``max_steps``."""

    def start(self, reset: Any) -> None:
        """Record the ``/reset`` answer: its observation joins the input; ``supports_explicit_close``."""
        if not isinstance(reset, dict):
            raise ProtocolError(f"/reset answered a {type(reset).__name__}; expected an object")
        self.supports_close = _info(reset, "/reset").get("supports_explicit_close") is True
        first = observation_message(reset)
        if first is not None:
            self.base_input.append(first)

    def add_response(self, response: dict[str, Any]) -> dict[str, Any]:
        """Record one model response; returns the ``/step`` body (the row + this turn's response)."""
        output = self._record(response)
        self.context_exhausted = not output and response.get("status") == "incomplete"
        return {**self.row, "response": response}

    def add_step(self, data: Any) -> StepAnswer:
        """Record one ``/step`` answer (validated); a finished episode adds no items."""
        step = StepAnswer(data)
        self.last_step = step
        self.total_reward += step.reward
        if not step.done:
            self.outputs.extend(step.items)
        return step

    def result(self) -> dict[str, Any]:
        """``/run``'s gymnasium result: row echo, the reset-extended params, response, reward, flags."""
        step = self.last_step
        finished = step is not None and step.done
        response = {
            **self.last_response,
            "output": self.outputs,
            "usage": self.usage,
            "status": "completed" if finished else "incomplete",
        }
        if self.context_exhausted:
            _with_termination_reason(response, "empty_output")
        return {
            **self.row,
            "responses_create_params": self.rcp,
            "response": response,
            "reward": self.total_reward,
            "terminated": step.terminated if step is not None else False,
            "truncated": (step.truncated if step is not None else False) or not finished,
            "info": step.info if step is not None else {},
            "mask_sample": False,
            "failure_kind": None,
            "failure_reason": None,
        }
