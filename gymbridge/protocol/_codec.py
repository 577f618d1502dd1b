"""Parse and dump helpers: the one place pydantic's ``ValidationError`` becomes ``ProtocolError``.

``parse_*`` take ``bytes`` / ``str`` (validated straight from JSON in Rust with
``model_validate_json``: no ``json.loads`` + validate double pass) or an already
decoded ``Mapping``. They pass the wire validation context, so what was parsed is
written back exactly: ``dump(parse(x)) == x``.

A body that does not fit raises :class:`gymbridge.errors.ProtocolError` with the
``ValidationError`` chained as ``__cause__`` and its structured errors in
``.errors`` (``loc`` given as the JSON path, union branch labels removed); the
message names the body, the location and the reason of each problem (branch noise
of the item unions, and of the two forms of ``response.output``, removed).

Wire keys are matched by their wire names only (``_ng_task_index``), never by the
Python field name: a dataset column called ``task_index`` stays an extra key.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from gymbridge.errors import ProtocolError
from gymbridge.protocol._base import WIRE_CONTEXT
from gymbridge.protocol._bodies import (
    AggregateMetrics,
    AggregateMetricsRequest,
    ResetResponse,
    RunRequest,
    RunResult,
    SeedSessionResponse,
    StepRequest,
    StepResponse,
    VerifyRequest,
    VerifyResponse,
)
from gymbridge.protocol._content import ContentPart
from gymbridge.protocol._items import Item
from gymbridge.protocol._responses import Response, ResponsesCreateParams

__all__ = [
    "dump",
    "dump_json",
    "parse",
    "parse_aggregate_metrics",
    "parse_aggregate_metrics_request",
    "parse_content_parts",
    "parse_items",
    "parse_reset_response",
    "parse_response",
    "parse_responses_create_params",
    "parse_run_request",
    "parse_run_result",
    "parse_seed_session_response",
    "parse_step_request",
    "parse_step_response",
    "parse_verify_request",
    "parse_verify_response",
]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
Data = bytes | bytearray | memoryview | str | Mapping[str, Any]

_ITEMS: TypeAdapter[list[Item]] = TypeAdapter(list[Item])
_PARTS: TypeAdapter[list[ContentPart]] = TypeAdapter(list[ContentPart])

# Error types produced by union dispatch rather than by the data's real problem.
_NOISE = frozenset({"union_tag_not_found", "union_tag_invalid", "gymbridge_known_type"})
_MAX_LISTED = 8


def _is_branch_label(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part[:1].isupper() or part == "str")


# the branch label of UnknownItem / UnknownPart / UnknownTool (bare or wrapped by its validators)
_FALLBACK_LABEL = re.compile(r"^(function-\w+\[.*)?Unknown(Item|Part|Tool)\]*$")


def _in_fallback_branch(err: Any) -> bool:
    return any(isinstance(part, str) and _FALLBACK_LABEL.match(part) for part in err["loc"])


def _is_noise(err: Any) -> bool:
    if err["type"] in _NOISE:
        return True
    if _in_fallback_branch(err) and err["loc"] and err["loc"][-1] == "type":
        return True  # the passthrough branch wanting a (new) ``type``
    # the ``str`` branch of ``str | list[...]`` complaining about a list
    return bool(err["type"] == "string_type" and err["loc"] and err["loc"][-1] == "str")


def _clean_errors(errors: list[Any]) -> list[Any]:
    """Keep the errors that explain the failure; drop what union dispatch adds around them.

    An item/part union reports one error per branch it tried. When a branch reached the
    real problem (a missing ``call_id``, a wrong token count) only that is kept; otherwise
    the dispatch errors that say what did not match (an unknown ``role``, a missing ``type``).
    """
    real = [e for e in errors if not _is_noise(e)]
    if real:
        return real
    dispatch = [
        e
        for e in errors
        if e["type"] == "union_tag_invalid"
        or (_in_fallback_branch(e) and e["type"] != "gymbridge_known_type")
    ]
    return dispatch or errors


# Errors that only say "this entry has the other shape" (an item where a transition list was
# expected, or the reverse): noise when the other branch of ``response.output`` explains more.
_SHAPE_ERRORS = frozenset({"list_type", "dict_type", "model_type", "model_attributes_type"})


def _output_branch(err: Any) -> str | None:
    """The ``response.output`` union branch (flat items vs transitions) an error came from."""
    for part in err["loc"]:
        if isinstance(part, str) and part.startswith("list["):
            return part
    return None


def _drop_wrong_shape_branch(errors: list[Any]) -> list[Any]:
    """Of the two ``response.output`` forms, report only the one the body was meant to be."""
    by_branch: dict[str, list[Any]] = {}
    for err in errors:
        branch = _output_branch(err)
        if branch is not None:
            by_branch.setdefault(branch, []).append(err)
    if len(by_branch) < 2:
        return errors
    wrong = {b for b, errs in by_branch.items() if all(e["type"] in _SHAPE_ERRORS for e in errs)}
    if wrong == set(by_branch):
        return errors  # neither form fits at all: say both
    return [e for e in errors if _output_branch(e) not in wrong]


def _shown_loc(err: Any) -> tuple[Any, ...]:
    return tuple(p for p in err["loc"] if not _is_branch_label(p))


def _drop_untyped_message_echo(errors: list[Any]) -> list[Any]:
    """Drop what the untyped-message branch repeats of a typed message's error.

    A bad ``{"type": "message", ...}`` fails in the typed branch (``…3.message.assistant.content``)
    and again in the branch for messages without ``type`` (``…3.assistant.content``); the
    second says nothing new.
    """
    typed = set()
    for err in errors:
        loc = _shown_loc(err)
        for k, part in enumerate(loc):
            if part == "message":
                typed.add(loc[:k] + loc[k + 1 :])
    return [err for err in errors if _shown_loc(err) not in typed]


def _format_loc(loc: tuple[Any, ...]) -> str:
    shown = [str(p) for p in loc if not _is_branch_label(p)]
    return ".".join(shown) or "<body>"


def _protocol_error(what: str, exc: ValidationError) -> ProtocolError:
    errors = exc.errors(include_url=False, include_input=False)
    cleaned = _drop_untyped_message_echo(_clean_errors(_drop_wrong_shape_branch(list(errors))))
    lines: list[str] = []
    seen: set[str] = set()
    for err in cleaned:
        line = f"{_format_loc(tuple(err['loc']))}: {err['msg']}"
        if line not in seen:
            seen.add(line)
            lines.append(line)
    shown = "; ".join(lines[:_MAX_LISTED])
    more = f" (+{len(lines) - _MAX_LISTED} more)" if len(lines) > _MAX_LISTED else ""
    # ``loc`` as the body spells it: union branch labels are pydantic internals, not JSON paths
    located = [{**err, "loc": _shown_loc(err)} for err in cleaned]
    return ProtocolError(f"invalid {what}: {shown}{more}", errors=located)


def _as_json_input(data: Data) -> bytes | str | None:
    if isinstance(data, bytes | str):
        return data
    if isinstance(data, bytearray | memoryview):
        return bytes(data)
    return None


def parse(model: type[M], data: Data) -> M:
    """Validate ``data`` (JSON bytes/str or a decoded mapping) as ``model``, losslessly.

    Raises :class:`ProtocolError` when it does not fit.
    """
    raw = _as_json_input(data)
    try:
        if raw is not None:
            return model.model_validate_json(raw, context=WIRE_CONTEXT, by_alias=True, by_name=False)
        if not isinstance(data, Mapping):
            raise TypeError(f"expected JSON bytes/str or a mapping, got {type(data).__name__}")
        return model.model_validate(data, context=WIRE_CONTEXT, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise _protocol_error(f"{model.__name__} body", exc) from exc


def parse_run_request(data: Data) -> RunRequest:
    """A dataset row / ``/run`` (and legacy ``/seed_session``, ``/reset``) body."""
    return parse(RunRequest, data)


def parse_run_result(data: Data) -> RunResult:
    """What ``<agent>/run`` returns."""
    return parse(RunResult, data)


def parse_verify_request(data: Data) -> VerifyRequest:
    """A ``/verify`` body."""
    return parse(VerifyRequest, data)


def parse_verify_response(data: Data) -> VerifyResponse:
    """What ``/verify`` returns."""
    return parse(VerifyResponse, data)


def parse_seed_session_response(data: Data) -> SeedSessionResponse:
    """What ``/seed_session`` returns."""
    return parse(SeedSessionResponse, data)


def parse_aggregate_metrics(data: Data) -> AggregateMetrics:
    """What ``/aggregate_metrics`` returns."""
    return parse(AggregateMetrics, data)


def parse_aggregate_metrics_request(data: Data) -> AggregateMetricsRequest:
    """A ``/aggregate_metrics`` body."""
    return parse(AggregateMetricsRequest, data)


def parse_reset_response(data: Data) -> ResetResponse:
    """What gymnasium ``/reset`` returns."""
    return parse(ResetResponse, data)


def parse_step_request(data: Data) -> StepRequest:
    """A gymnasium ``/step`` body."""
    return parse(StepRequest, data)


def parse_step_response(data: Data) -> StepResponse:
    """What gymnasium ``/step`` returns."""
    return parse(StepResponse, data)


def parse_response(data: Data) -> Response:
    """A Responses-API response (what ``/v1/responses`` returns)."""
    return parse(Response, data)


def parse_responses_create_params(data: Data) -> ResponsesCreateParams:
    """A ``/v1/responses`` body / a row's ``responses_create_params``."""
    return parse(ResponsesCreateParams, data)


def _parse_list(adapter: TypeAdapter[list[Any]], what: str, data: bytes | str | list[Any]) -> list[Any]:
    try:
        if isinstance(data, bytes | str):
            return adapter.validate_json(data, context=WIRE_CONTEXT, by_alias=True, by_name=False)
        return adapter.validate_python(data, context=WIRE_CONTEXT, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise _protocol_error(what, exc) from exc


def parse_items(data: bytes | str | list[Any]) -> list[Item]:
    """A JSON list of Responses-API items (input or output)."""
    return _parse_list(_ITEMS, "item list", data)


def parse_content_parts(data: bytes | str | list[Any]) -> list[ContentPart]:
    """A JSON list of content parts (e.g. a ``function_call_output.output`` list)."""
    return _parse_list(_PARTS, "content part list", data)


def dump(model: BaseModel | list[Any]) -> Any:
    """The JSON-ready form of a wire model (or a list of them): aliases, set fields, extras."""
    if isinstance(model, list):
        return [dump(entry) for entry in model]
    return model.model_dump(mode="json", by_alias=True, exclude_unset=True)


def dump_json(model: BaseModel | list[Any]) -> bytes:
    """UTF-8 JSON bytes of :func:`dump`, serialised in Rust."""
    if isinstance(model, list):
        return b"[" + b",".join(dump_json(entry) for entry in model) + b"]"
    return type(model).__pydantic_serializer__.to_json(model, by_alias=True, exclude_unset=True)
