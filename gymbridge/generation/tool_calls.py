"""Tool-call formats: the text a model writes to call a function, parsed into calls and written back.

Two formats, one interface (:class:`ToolCallFormat`: ``parse(text, tools)``, ``render(name, arguments)``),
used the same way by every backend through :meth:`ChatCodec.parse <gymbridge.generation.chat.ChatCodec.parse>`
(the HF and vLLM generators, the model server, native rollouts):

* ``hermes``: ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`` (Qwen2 / 2.5 / 3 (-VL),
  InternVL, Hermes; every tiny family's template, Gemma 3's included);
* ``qwen3_coder``: ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>`` (Qwen3-Coder, Qwen3.5; vLLM's ``qwen3_coder`` parser). One newline
  after ``<parameter=P>`` and one before ``</parameter>`` are markup; the rest is the value. A
  parameter the request's tool schema types is converted to that type (``integer``, ``number``,
  ``boolean`` (``true`` / ``True``), ``null``, ``object``, ``array``; ``string`` stays text; a value
  that does not convert is read as an untyped one); an untyped parameter (no schema) is the JSON
  number, boolean, null, array or object its whole text spells, else the text itself.

``auto`` (:func:`resolve_tool_parser`) reads the chat template: one that writes ``<function=`` /
``<parameter=`` is ``qwen3_coder``, anything else (``<tool_call>`` with JSON, or no tool format at
all) ``hermes``.

Invariants:

* round trip: a call written as the chat template writes it parses back to the same call, and
  rendering the parsed call gives the same text, so the conversation rebuilt from the parsed items
  reproduces what the model emitted (values keep their types with a schema; without one, a string
  that spells another JSON value reads as that value);
* nothing is dropped: text that is not a parsed call stays in the message content, in order.

``tool_call_unparsed``: text that looks like a tool call but does not parse in the format in use
(a ``<tool_call>`` block that is malformed or never closed, a stray ``</tool_call>``, a
``<function=`` outside a block, an unclosed or repeated ``<parameter=``, two functions in one block:
vLLM reads some of these leniently, but no template writes them back) is an
:class:`UnparsedToolCall`. Such a rollout is **not** a failure: its markup stays in the message
content, the environment sees a plain message and scores it (usually 0), and the sample is
trained like any other, because that reward is exactly the signal the policy must learn from.
It is made loud instead: the model server counts ``tool_calls_unparsed`` (beside
``tool_calls_parsed``) in ``GET /counters``, which each step's record carries as
``generator/tool_calls_unparsed``; the message item carries ``tool_call_errors``
(:func:`mark_unparsed`: kind, format, reason, the markup), so a rollout record says why; and the
first one a server sees is logged as a warning.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

__all__ = [
    "TOOL_CALL_UNPARSED",
    "TOOL_PARSERS",
    "HermesFormat",
    "Qwen3CoderFormat",
    "ToolCall",
    "ToolCallFormat",
    "ToolCallParse",
    "ToolParserName",
    "UnparsedToolCall",
    "detect_tool_parser",
    "mark_unparsed",
    "new_call_id",
    "resolve_tool_parser",
    "tool_call_format",
]

ToolParserName = Literal["auto", "hermes", "qwen3_coder"]
TOOL_PARSERS: tuple[str, ...] = get_args(ToolParserName)
"""Every ``tool_parser`` setting (``generator.tool_parser``, ``gymbridge model serve --tool-parser``)."""
TOOL_CALL_UNPARSED = "tool_call_unparsed"
"""The failure class of markup that looks like a tool call but does not parse (module docstring)."""

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_FUNCTION = "<function="
_FUNCTION_END = "</function>"
_PARAMETER = "<parameter="
_PARAMETER_END = "</parameter>"
_MARKUP_CHARS = 200
"""Characters of an unparsed call's markup kept in its record (the message content holds it all)."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call. ``arguments`` is the JSON string the model produced (or was replayed)."""

    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class UnparsedToolCall:
    """Markup that looks like a tool call but does not parse: failure class ``tool_call_unparsed``."""

    format: str
    """The format the text was parsed in (``hermes``, ``qwen3_coder``)."""
    reason: str
    markup: str
    """The markup as generated (it also stays in the message content)."""
    kind: ClassVar[str] = TOOL_CALL_UNPARSED

    def as_json(self) -> dict[str, str]:
        """The record put on the message item (``tool_call_errors``); the markup cut to 200 characters."""
        markup = self.markup if len(self.markup) <= _MARKUP_CHARS else self.markup[:_MARKUP_CHARS] + "..."
        return {"kind": self.kind, "format": self.format, "reason": self.reason, "markup": markup}


@dataclass(frozen=True, slots=True)
class ToolCallParse:
    """A text split into message content, the calls that parsed and the markup that did not."""

    content: str
    """The text without the parsed calls (stripped when any call parsed)."""
    calls: list[ToolCall] = field(default_factory=list)
    unparsed: list[UnparsedToolCall] = field(default_factory=list)


_STRAY = re.compile(r"</tool_call>|<function=.*?(?:</function>|\Z)", re.DOTALL)
"""Markup outside a block: a closing tag without its opening one, a function call without a block."""


class _Unparsed(Exception):
    """A block's body does not parse; the message is the reason."""


class ToolCallFormat(ABC):
    """One tool-call format (module docstring). Subclasses parse one ``<tool_call>`` block's body."""

    name: ClassVar[str]

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ToolCallParse:
        """Split ``text`` into content, calls and unparsed markup; ``tools`` (Chat Completions or flat
        function specs, the request's) type the parameters of a format that needs it."""
        calls: list[ToolCall] = []
        unparsed: list[UnparsedToolCall] = []
        kept: list[str] = []
        pos = 0

        def bad(start: int, end: int, reason: str) -> None:
            unparsed.append(UnparsedToolCall(self.name, reason, text[start:end]))
            kept.append(text[start:end])

        while pos < len(text):
            start = text.find(_OPEN, pos)
            stop = len(text) if start < 0 else start
            self._plain(text, pos, stop, bad, kept)
            if start < 0:
                break
            body_at = start + len(_OPEN)
            close = text.find(_CLOSE, body_at)
            reopen = text.find(_OPEN, body_at)
            if close < 0:
                bad(start, len(text), f"{_OPEN} is never closed by {_CLOSE} (or the generation was cut)")
                break
            if 0 <= reopen < close:
                bad(start, reopen, f"{_OPEN} is not closed before the next {_OPEN}")
                pos = reopen
                continue
            end = close + len(_CLOSE)
            try:
                name, arguments = self._body(text[body_at:close], tools)
            except _Unparsed as exc:
                bad(start, end, str(exc))
            else:
                calls.append(ToolCall(call_id=new_call_id(), name=name, arguments=arguments))
            pos = end
        content = "".join(kept)
        return ToolCallParse(content.strip() if calls else content, calls, unparsed)

    @staticmethod
    def _plain(
        text: str, start: int, stop: int, bad: Callable[[int, int, str], None], kept: list[str]
    ) -> None:
        """Text outside the blocks: kept; a stray ``</tool_call>`` or ``<function=...`` is unparsed markup."""
        pos = start
        for match in _STRAY.finditer(text, start, stop):
            kept.append(text[pos : match.start()])
            if match.group(0) == _CLOSE:
                bad(match.start(), match.end(), f"{_CLOSE} without its {_OPEN}")
            else:
                bad(match.start(), match.end(), f"{_FUNCTION}...> outside a {_OPEN} block")
            pos = match.end()
        kept.append(text[pos:stop])

    @abstractmethod
    def _body(self, body: str, tools: Sequence[Mapping[str, Any]] | None) -> tuple[str, str]:
        """``(name, arguments JSON)`` of one block's body, or :class:`_Unparsed` saying why not."""

    @abstractmethod
    def render(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call as the format's chat templates write it (the canonical text)."""

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        """Several calls, one block each, separated by one newline (as the templates join them)."""
        return "\n".join(self.render(c.name, _arguments_object(c.arguments)) for c in calls)


class HermesFormat(ToolCallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; ``parameters`` reads as ``arguments``."""

    name = "hermes"

    def _body(self, body: str, tools: Sequence[Mapping[str, Any]] | None) -> tuple[str, str]:
        stripped = body.strip()
        try:
            obj = json.loads(stripped)
        except ValueError as exc:
            hint = (
                " (it is the qwen3_coder form: set the tool parser to qwen3_coder)"
                if stripped.startswith(_FUNCTION)
                else ""
            )
            raise _Unparsed(f"the call is not JSON: {exc}{hint}") from exc
        if not isinstance(obj, dict):
            raise _Unparsed(f"the call is JSON but not an object ({type(obj).__name__})")
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            raise _Unparsed("the call has no 'name' string")
        return name, _arguments_json(obj.get("arguments", obj.get("parameters", {})))

    def render(self, name: str, arguments: Mapping[str, Any]) -> str:
        args = json.dumps(dict(arguments), ensure_ascii=False)
        return f'{_OPEN}\n{{"name": "{name}", "arguments": {args}}}\n{_CLOSE}'


_FUNCTION_BLOCK = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*", re.DOTALL)
_PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]*)>")


class Qwen3CoderFormat(ToolCallFormat):
    """``<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>``; values
    typed by the tool's schema (module docstring)."""

    name = "qwen3_coder"

    def _body(self, body: str, tools: Sequence[Mapping[str, Any]] | None) -> tuple[str, str]:
        match = _FUNCTION_BLOCK.fullmatch(body)
        if match is None:
            raise _Unparsed(self._why_not(body))
        name, inner = match.group(1).strip(), match.group(2)
        if not name:
            raise _Unparsed(f"{_FUNCTION}> has no function name")
        if _FUNCTION in inner:
            raise _Unparsed(f"more than one {_FUNCTION}...> in one {_OPEN} block")
        properties = _properties(tools, name)
        arguments: dict[str, Any] = {}
        pos = 0
        while True:
            while pos < len(inner) and inner[pos].isspace():
                pos += 1
            if pos == len(inner):
                break
            opened = _PARAMETER_OPEN.match(inner, pos)
            if opened is None:
                raise _Unparsed(f"text outside {_PARAMETER}...>: {inner[pos : pos + 40]!r}")
            param = opened.group(1).strip()
            if not param:
                raise _Unparsed(f"{_PARAMETER}> has no parameter name")
            end = inner.find(_PARAMETER_END, opened.end())
            if end < 0:
                raise _Unparsed(f"{_PARAMETER}{param}> is never closed by {_PARAMETER_END}")
            raw = inner[opened.end() : end]
            if _PARAMETER in raw:
                raise _Unparsed(f"{_PARAMETER}{param}> is not closed before the next {_PARAMETER}")
            if param in arguments:
                raise _Unparsed(f"parameter {param!r} is given twice")
            arguments[param] = _typed_value(_unwrap(raw), properties.get(param))
            pos = end + len(_PARAMETER_END)
        return name, json.dumps(arguments, ensure_ascii=False)

    @staticmethod
    def _why_not(body: str) -> str:
        stripped = body.strip()
        if stripped.startswith("{"):
            return (
                "the call is JSON, not <function=...>: it is the hermes form (set the tool parser to hermes)"
            )
        if not stripped.startswith(_FUNCTION):
            return f"the block does not start with {_FUNCTION}NAME>"
        if _FUNCTION_END not in stripped:
            return f"{_FUNCTION}...> is never closed by {_FUNCTION_END}"
        if ">" not in stripped.split("\n", 1)[0]:
            return f"{_FUNCTION}NAME> is not closed by '>'"
        return f"text after {_FUNCTION_END}"

    def render(self, name: str, arguments: Mapping[str, Any]) -> str:
        params = "".join(
            f"{_PARAMETER}{k}>\n{_value_text(v)}\n{_PARAMETER_END}\n" for k, v in arguments.items()
        )
        return f"{_OPEN}\n{_FUNCTION}{name}>\n{params}{_FUNCTION_END}\n{_CLOSE}"


_FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HermesFormat(), Qwen3CoderFormat())}


def tool_call_format(name: str) -> ToolCallFormat:
    """The format called ``name`` (``hermes``, ``qwen3_coder``); ``ValueError`` for any other."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}: one of {', '.join(sorted(_FORMATS))}") from None


def detect_tool_parser(chat_template: str | Mapping[str, Any] | None) -> str:
    """The format a chat template writes tool calls in: ``qwen3_coder`` when it writes ``<function=``
    or ``<parameter=``, else ``hermes`` (``<tool_call>`` with JSON, and the fallback)."""
    if isinstance(chat_template, Mapping):  # named templates ({"default": ..., "tool_use": ...})
        chat_template = "\n".join(str(t) for t in chat_template.values())
    text = chat_template or ""
    return "qwen3_coder" if _FUNCTION in text or _PARAMETER in text else "hermes"


def resolve_tool_parser(setting: str, chat_template: str | Mapping[str, Any] | None) -> str:
    """``setting`` (one of :data:`TOOL_PARSERS`) as a format name: ``auto`` reads ``chat_template``."""
    if setting == "auto":
        return detect_tool_parser(chat_template)
    return tool_call_format(setting).name


def mark_unparsed(items: list[dict[str, Any]], unparsed: Sequence[UnparsedToolCall]) -> None:
    """Put ``tool_call_errors`` (:meth:`UnparsedToolCall.as_json` each) on the assistant message
    item of ``items`` (Responses output items), which holds the unparsed markup."""
    if not unparsed:
        return
    message = next((i for i in items if i.get("type") == "message"), None)
    if message is not None:
        message["tool_call_errors"] = [u.as_json() for u in unparsed]


# --------------------------------------------------------------------------- values


def _arguments_json(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _arguments_object(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _unwrap(raw: str) -> str:
    """A parameter's text without the template's newline after the opening and before the closing tag."""
    raw = raw.removeprefix("\n")
    return raw.removesuffix("\n")


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _properties(tools: Sequence[Mapping[str, Any]] | None, name: str) -> Mapping[str, Any]:
    """The JSON-schema ``properties`` of tool ``name`` among ``tools`` (``{}`` when not declared)."""
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and fn.get("name") == name:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, Mapping) else None
            return props if isinstance(props, Mapping) else {}
    return {}


_JSON_KIND = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a property schema allows (``type``, ``enum`` values, ``anyOf``/``oneOf``/``allOf``)."""
    if not isinstance(schema, Mapping):
        return set()
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        types.update("null" if v is None else _JSON_KIND.get(type(v), "string") for v in enum)
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        if isinstance(choices, list):
            for choice in choices:
                types |= _schema_types(choice)
    return types


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json(text: str) -> tuple[bool, Any]:
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError:
        return False, None
    return _finite(value), value


_INTEGER = re.compile(r"-?\d+")


def _as_type(text: str, kind: str) -> tuple[bool, Any]:
    """``text`` as JSON type ``kind``, or ``(False, None)``."""
    stripped = text.strip()
    if kind == "null":
        return (True, None) if stripped.lower() in ("null", "none") else (False, None)
    if kind == "integer":
        return (True, int(stripped)) if _INTEGER.fullmatch(stripped) else (False, None)
    if kind == "boolean":
        lowered = stripped.lower()
        return (True, lowered == "true") if lowered in ("true", "false") else (False, None)
    ok, value = _json(stripped)
    if kind == "number":
        ok = ok and isinstance(value, int | float) and not isinstance(value, bool)
    elif kind in ("object", "array"):
        ok = ok and isinstance(value, dict if kind == "object" else list)
    else:
        ok = False
    return (ok, value) if ok else (False, None)


_TYPE_ORDER = ("null", "integer", "number", "boolean", "object", "array")


def _typed_value(text: str, schema: Any) -> Any:
    """A qwen3_coder parameter's value: by the schema's types in order (``string`` last), else untyped."""
    types = _schema_types(schema)
    for kind in _TYPE_ORDER:
        if kind in types:
            ok, value = _as_type(text, kind)
            if ok:
                return value
    if "string" in types:
        return text
    ok, value = _json(text.strip()) if text.strip() else (False, None)
    return value if ok and not isinstance(value, str) else text
