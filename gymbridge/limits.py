"""One JSON nesting limit for every body gymbridge accepts.

orjson *reads* 1024 levels but *writes* only 254: a body nested deeper than that parses,
then fails when it is echoed (a verify result holds the whole row). Every body
gymbridge accepts — requests of the server SDK, the agent and the model server, inner
servers' replies read by the agent and the native loop, the client's rows and the agent's
results — is held to :data:`MAX_JSON_DEPTH`, well below orjson's writing limit so a body at
the limit can still be wrapped a few levels deeper and written back.

Invariants: :func:`json_too_deep` never recurses (an adversarial body cannot exhaust the
Python stack) and counts only arrays and objects (``[]`` is depth 1, a scalar depth 0);
:func:`loads_json` raises :class:`~gymbridge.errors.ProtocolError` for malformed or too
deep input and nothing else.
"""

from __future__ import annotations

from typing import Any

import orjson

from gymbridge.errors import JsonTooDeepError, ProtocolError

__all__ = ["MAX_JSON_DEPTH", "JsonTooDeepError", "check_json_depth", "json_too_deep", "loads_json"]

MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays/objects accepted in any JSON body (orjson writes at most 254)."""


def json_too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when ``value`` (parsed JSON: dicts, lists, scalars) nests deeper than ``limit``."""
    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def check_json_depth(value: Any, what: str = "JSON body", limit: int = MAX_JSON_DEPTH) -> Any:
    """``value`` unchanged; :class:`JsonTooDeepError` naming ``what`` when it nests deeper than ``limit``."""
    if json_too_deep(value, limit):
        raise JsonTooDeepError(f"{what} nests arrays/objects deeper than {limit} levels")
    return value


def loads_json(raw: bytes | bytearray | memoryview | str, what: str = "JSON body") -> Any:
    """Parse ``raw`` with orjson and hold it to :data:`MAX_JSON_DEPTH` (:class:`ProtocolError` otherwise)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):  # orjson's own limit (1024) is past ours
            raise JsonTooDeepError(
                f"{what} nests arrays/objects deeper than {MAX_JSON_DEPTH} levels"
            ) from None
        raise ProtocolError(f"{what} is not valid JSON: {exc}") from None
    if isinstance(raw, str):
        brackets = raw.count("[") + raw.count("{")
    else:
        data = bytes(raw) if isinstance(raw, memoryview) else raw
        brackets = data.count(b"[") + data.count(b"{")
    if brackets <= MAX_JSON_DEPTH:  # cheap bound: cannot nest deeper than it has brackets
        return value
    return check_json_depth(value, what)
