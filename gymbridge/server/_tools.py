"""Typed tools: the ``@tool`` decorator, argument validation, JSON schemas, tool outputs.

An environment author writes a tool as a method with type-hinted keyword
parameters (``Annotated[int, Field(description=...)]`` adds per-argument
descriptions) or with one pydantic-model parameter. From the hints we build a
pydantic model once, at class creation; it validates every call and yields the
JSON schema published as a Responses-API function tool
(``{"type": "function", "name", "description", "parameters", "strict"}``).

Published schemas follow stock Gym rows (e.g. ``circle_click``,
``example_session_state_mgmt``): no pydantic ``title`` keys, every object
``additionalProperties: false`` with an explicit ``required`` list, and
``strict: true``, so a server doing constrained decoding (vLLM, OpenAI
strict mode) can only emit valid calls. OpenAI strict mode needs every
property required; a tool with an optional (defaulted) argument is published
with ``strict: false`` and its optional arguments left out of ``required``.

Invariants:

* a parameter named ``session`` (or annotated :class:`Session`) receives the
  caller's session and is never part of the schema;
* every constraint in the schema is enforced by validation (same pydantic
  model); unknown extra keys are ignored rather than refused, as a stock Gym
  (FastAPI) resources server does;
* bad arguments answer 422 with FastAPI's ``{"detail": [...]}`` shape, as a
  stock Gym server does, so the model sees the same error text either way.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from gymbridge.media import encode_data_url
from gymbridge.server._base import HttpError, Session

__all__ = [
    "ToolOutput",
    "ToolSpec",
    "audio_part",
    "image_part",
    "media_part",
    "tool",
    "video_part",
]

F = TypeVar("F", bound=Callable[..., Any])

TOOL_ATTR = "__gymbridge_tool__"
PARTS_HEADER = "X-Gymbridge-Tool-Output"
"""Response header marking a tool body as a JSON list of Responses input parts."""


@runtime_checkable
class _DataUrlMedia(Protocol):
    """What we need of ``gymbridge.media.MediaItem`` (duck-typed: no import cycle)."""

    modality: str

    def to_data_url(self) -> str: ...


def image_part(image: bytes | str, mime: str = "image/png", detail: str = "auto") -> dict[str, Any]:
    """An ``input_image`` part from encoded bytes or an existing URL / data URL (``detail`` always sent)."""
    url = image if isinstance(image, str) else encode_data_url(image, mime)
    return {"type": "input_image", "image_url": url, "detail": detail}


def audio_part(audio: bytes | str, mime: str = "audio/wav") -> dict[str, Any]:
    """An ``input_audio`` part (gymbridge extension; stock Gym carries audio in metadata)."""
    url = audio if isinstance(audio, str) else encode_data_url(audio, mime)
    return {"type": "input_audio", "audio_url": url}


def video_part(video: bytes | str, mime: str = "video/mp4") -> dict[str, Any]:
    """An ``input_video`` part from encoded bytes or a ``file://`` / data URL."""
    url = video if isinstance(video, str) else encode_data_url(video, mime)
    return {"type": "input_video", "video_url": url}


def media_part(item: Any) -> dict[str, Any]:
    """A content part for a ready-made part dict or a ``MediaItem``-like object."""
    if isinstance(item, dict):
        return item
    if isinstance(item, _DataUrlMedia):
        url = item.to_data_url()
        if item.modality == "audio":
            return audio_part(url)
        if item.modality == "video":
            return video_part(url)
        return image_part(url)
    raise TypeError(f"cannot turn {type(item).__name__} into a content part")


@dataclass
class ToolOutput:
    """A tool result with media: text for the model plus image / audio / video parts.

    Sent as a JSON list of Responses input parts (``input_text`` first), marked
    by the ``X-Gymbridge-Tool-Output: parts`` header. A stock agent passes the
    text through verbatim; gymbridge's agent shows the media to the model.
    """

    text: str = ""
    media: Sequence[Any] = field(default_factory=list)

    def parts(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"type": "input_text", "text": self.text}] if self.text else []
        out.extend(media_part(m) for m in self.media)
        return out


@dataclass(frozen=True)
class ToolSpec:
    """One declared tool: its name, description, argument model and implementation."""

    name: str
    description: str
    args_model: type[BaseModel]
    fn: Callable[..., Any]
    session_param: str | None
    model_param: str | None
    """Set when the tool takes one pydantic-model parameter instead of keywords."""

    def schema(self) -> dict[str, Any]:
        """The JSON schema of the arguments (stock shape: no titles, closed objects)."""
        schema: dict[str, Any] = _stock_schema(self.args_model.model_json_schema())
        schema.setdefault("type", "object")
        return schema

    @property
    def strict(self) -> bool:
        """True when the schema satisfies OpenAI strict mode (every property of every object required)."""
        return strict_schema_ok(self.schema())

    def function_tool(self) -> dict[str, Any]:
        """The Responses-API function tool for ``responses_create_params.tools``."""
        schema = self.schema()
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": schema,
            "strict": strict_schema_ok(schema),
        }

    def validate(self, arguments: Any) -> dict[str, Any]:
        """Keyword arguments for the implementation, or ``HttpError(422)`` in FastAPI's shape."""
        if not isinstance(arguments, dict):
            raise HttpError(
                422,
                {
                    "detail": [
                        {"type": "dict_type", "loc": ["body"], "msg": "Input should be a valid dictionary"}
                    ]
                },
            )
        try:
            parsed = self.args_model.model_validate(arguments)
        except ValidationError as exc:
            detail = [
                {
                    "type": e["type"],
                    "loc": ["body", *e["loc"]],
                    "msg": e["msg"],
                    "input": _jsonable(e.get("input")),
                }
                for e in exc.errors()
            ]
            raise HttpError(422, {"detail": detail}) from None
        if self.model_param is not None:
            return {self.model_param: parsed}
        return {name: getattr(parsed, name) for name in type(parsed).model_fields}

    async def call(self, owner: Any, session: Session, arguments: Any) -> Any:
        kwargs = self.validate(arguments)
        if self.session_param is not None:
            kwargs[self.session_param] = session
        result = self.fn(owner, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result


def _stock_schema(node: Any) -> Any:
    """Drop pydantic ``title`` keys; close every object (``additionalProperties: false``, ``required``)."""
    if isinstance(node, list):
        return [_stock_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs") and isinstance(value, dict):
            # property / definition names are data, not schema keywords: keep "title" as a name
            out[key] = {name: _stock_schema(sub) for name, sub in value.items()}
        else:
            out[key] = _stock_schema(value)
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("properties", {})
        out.setdefault("required", [])
        out.setdefault("additionalProperties", False)
    return out


def strict_schema_ok(node: Any) -> bool:
    """Whether ``node`` meets OpenAI strict mode: every object closed and all its properties required."""
    if isinstance(node, list):
        return all(strict_schema_ok(v) for v in node)
    if not isinstance(node, dict):
        return True
    if "properties" in node and isinstance(node["properties"], dict):
        if node.get("additionalProperties") is not False:
            return False
        if set(node.get("required", [])) != set(node["properties"]):
            return False
    for key, value in node.items():
        if key in ("properties", "$defs") and isinstance(value, dict):
            if not all(strict_schema_ok(sub) for sub in value.values()):
                return False
        elif not strict_schema_ok(value):
            return False
    return True


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool, list, dict)):
        return value
    return repr(value)


def _first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    return inspect.cleandoc(doc).split("\n\n", 1)[0].replace("\n", " ").strip()


def build_spec(fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> ToolSpec:
    """Derive a :class:`ToolSpec` from ``fn``'s signature and type hints."""
    hints = typing.get_type_hints(fn, include_extras=True)
    params = list(inspect.signature(fn).parameters.values())[1:]  # drop self
    session_param: str | None = None
    fields: dict[str, Any] = {}
    for p in params:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *args/**kwargs are not allowed; declare each argument")
        hint = hints.get(p.name, Any)
        if p.name == "session" or hint is Session:
            session_param = p.name
            continue
        if p.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise TypeError(f"tool {fn.__name__}: positional-only argument {p.name!r} is not allowed")
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (hint, default)
    tool_name = name or fn.__name__
    if len(fields) == 1:
        only_name, (only_hint, _) = next(iter(fields.items()))
        if isinstance(only_hint, type) and issubclass(only_hint, BaseModel):
            return ToolSpec(
                name=tool_name,
                description=description or _first_paragraph(fn.__doc__),
                args_model=only_hint,
                fn=fn,
                session_param=session_param,
                model_param=only_name,
            )
    args_model = create_model(f"{tool_name}_args", __config__=ConfigDict(extra="ignore"), **fields)
    return ToolSpec(
        name=tool_name,
        description=description or _first_paragraph(fn.__doc__),
        args_model=args_model,
        fn=fn,
        session_param=session_param,
        model_param=None,
    )


def tool(
    fn: F | None = None, *, name: str | None = None, description: str | None = None
) -> F | Callable[[F], F]:
    """Mark a ``ResourcesServer`` method as a tool served at ``POST /<name>``.

    Usable bare (``@tool``) or with options (``@tool(name="click", description=...)``).
    The description defaults to the docstring's first paragraph.
    """

    def mark(f: F) -> F:
        setattr(f, TOOL_ATTR, {"name": name, "description": description})
        return f

    if fn is not None:
        return mark(fn)
    return mark
