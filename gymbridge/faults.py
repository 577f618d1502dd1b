"""Which failures are whose: environment faults mid-episode, and refusals a stock server wraps in a 500.

One rule for the agent, the native loop, the server SDK and the client (docs/http.md,
*Tool errors and environment faults*):

* a tool or ``/step`` answer is an **environment fault** when it broke (refused, reset, closed
  mid-body), passed its deadline, or has a status a client retries other than 500: 502, 503,
  504 and the other 5xx, 408, 429 (a proxy, an overloaded or restarting server). Any other
  answer is the tool's: a 4xx with its message, an error payload, and a 500 (the tool's own
  exception, which stock Gym shows the model) go back to the model as the tool's output
  (``/step`` has no such channel: its 4xx and 500 end the rollout as before);
* an agent ends the rollout at the first fault with a **masked result** (:func:`masked_result`),
  the 0.7.0 shape for "the reward is not a valid measurement": HTTP 200, the row echoed, the
  conversation so far, ``reward: 0.0``, ``mask_sample: true``, ``failure_kind`` from 0.7.0's
  shared vocabulary (:data:`ENV_FAULT_KINDS`), ``failure_reason`` naming the tool and the status,
  and ``env_fault: {route, tool, status}``. Genuine consumers already leave such a sample out of
  scores and training; a 5xx instead would end every rollout in flight of a genuine
  ``run_examples`` call (it raises on a failed ``/run`` unless failures are routed to a sidecar);
* a client reads a masked result whose ``failure_kind`` is in :data:`ENV_FAULT_KINDS` as an
  infrastructure failure (:func:`fault_of_result`): retried, recorded if it stays failed, never
  trained. A masked result of another kind (an environment's own ``judge_failed``) stays a
  result, trained with its loss masked;
* a NeMo Gym server whose inner call fails answers **500** with the JSON string ``"Hit an
  exception in <server> calling an inner server: <the inner body>"`` (the inner status is
  lost; the body is a Python bytes literal ``b'...'`` in genuine servers). When the inner body
  is an inner server's *refusal* (vLLM's / OpenAI's error object with a 4xx ``code``, FastAPI's
  422 ``detail`` list), :func:`wrapped_client_error` finds that status, so a model server
  refusing a row's sampling parameters behind genuine ``vllm_model`` or ``simple_agent`` is a
  data failure at once, not an infrastructure fault retried.

Invariant: :func:`status_fault_kind` is the only place the fault statuses are listed; reading a
wrapped body never evaluates it (``ast.literal_eval`` of a bytes literal at most).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any

from gymbridge.errors import EnvError, EnvFaultError, EnvTimeoutError, EnvTransportError

__all__ = [
    "ENV_FAULT_KINDS",
    "TRANSPORT_PEER_DROP",
    "TRANSPORT_TIMEOUT",
    "TRANSPORT_UNREACHABLE",
    "env_fault",
    "fault_of_result",
    "fault_record",
    "masked_result",
    "status_fault_kind",
    "wrapped_client_error",
]

TRANSPORT_UNREACHABLE = "transport_unreachable"
"""0.7.0's name for a server that could not be reached or would not serve (refused, 502, 503, 429)."""
TRANSPORT_PEER_DROP = "transport_peer_drop"
"""0.7.0's name for a connection the server broke (reset, closed in the middle of its body)."""
TRANSPORT_TIMEOUT = "transport_timeout"
"""0.7.0's name for an answer that did not come in time (the deadline, 504, 408)."""
ENV_FAULT_KINDS = frozenset(
    {TRANSPORT_UNREACHABLE, TRANSPORT_PEER_DROP, TRANSPORT_TIMEOUT, "transport_local_resource"}
)
"""The ``failure_kind`` s (0.7.0's transport domain: reaching another process at all) that make a
masked result an infrastructure failure for :func:`fault_of_result`."""
_DETAIL_CHARS = 500


def status_fault_kind(status: int) -> str | None:
    """The fault an answer's ``status`` is (its 0.7.0 ``failure_kind``), or None: the tool's own answer."""
    if status in (408, 504):
        return TRANSPORT_TIMEOUT
    if status == 429 or 500 < status < 600:
        return TRANSPORT_UNREACHABLE
    return None


def env_fault(
    route: str,
    *,
    tool: str | None = None,
    status: int | None = None,
    body: str = "",
    error: EnvError | None = None,
    server: str | None = None,
) -> EnvFaultError:
    """The fault of one call to ``route``: its answer's ``status`` and ``body``, or the error it raised."""
    what = f"tool {tool!r}" if tool is not None else route
    if error is not None:
        if isinstance(error, EnvTimeoutError):
            kind, how = TRANSPORT_TIMEOUT, "passed its deadline"
        elif isinstance(error, EnvTransportError) and error.reached is False:
            kind, how = TRANSPORT_UNREACHABLE, "could not be reached"
        else:
            kind, how = TRANSPORT_PEER_DROP, "broke the connection"
        detail = str(error)
    else:
        if status is None:
            raise ValueError("env_fault needs the answer's status or the error the call raised")
        found = status_fault_kind(status)
        if found is None:
            raise ValueError(f"HTTP {status} is the tool's own answer, not an environment fault")
        kind, how, detail = found, f"answered HTTP {status}", body
    reason = f"environment fault: {what} {how}: {detail[:_DETAIL_CHARS]}"
    return EnvFaultError(reason, route=route, failure_kind=kind, status=status, tool=tool, server=server)


def fault_record(fault: EnvFaultError) -> dict[str, Any]:
    """The ``env_fault`` object of a masked result: ``{route, tool, status}``."""
    return {"route": fault.route, "tool": fault.tool, "status": fault.status}


def masked_result(result: Mapping[str, Any], fault: EnvFaultError) -> dict[str, Any]:
    """``result`` (the row echo + ``response`` so far, or a gymnasium result) ended by ``fault``.

    The response is marked ``incomplete`` (``metadata.ng_termination_reason: "env_fault"``); the
    reward is 0.0 and ``mask_sample`` true: the sample is not a measurement of the policy.
    """
    response = dict(result.get("response") or {})
    metadata = response.get("metadata")
    kept = metadata if isinstance(metadata, dict) else {}
    response["metadata"] = {**kept, "ng_termination_reason": "env_fault"}
    response["status"] = "incomplete"
    return {
        **result,
        "response": response,
        "reward": 0.0,
        "mask_sample": True,
        "failure_kind": fault.failure_kind,
        "failure_reason": str(fault),
        "env_fault": fault_record(fault),
    }


def fault_of_result(result: Mapping[str, Any], server: str | None = None) -> EnvFaultError | None:
    """The environment fault a ``/run`` result reports (a masked result of a transport kind), or None."""
    kind = result.get("failure_kind")
    if result.get("mask_sample") is not True or kind not in ENV_FAULT_KINDS:
        return None
    record = result.get("env_fault")
    record = record if isinstance(record, Mapping) else {}
    status = record.get("status")
    tool = record.get("tool")
    route = record.get("route")
    reason = result.get("failure_reason")
    return EnvFaultError(
        str(reason) if reason else f"environment fault ({kind}) reported without a reason",
        route=route if isinstance(route, str) else "",
        failure_kind=str(kind),
        status=status if isinstance(status, int) and not isinstance(status, bool) else None,
        tool=tool if isinstance(tool, str) else None,
        server=server,
    )


_WRAPPED = "calling an inner server: "
_MAX_WRAPPED_CHARS = 1 << 20
_MAX_WRAPPING = 4
"""Servers wrapping servers: our agent -> genuine vllm_model -> vLLM is two."""


def wrapped_client_error(status: int, body: str) -> int | None:
    """The 4xx an inner server refused a request with, when a stock server wrapped it in a 500.

    ``body`` is the 500's body text. Returns the inner status (400, 422, ...; never 408 / 429,
    which are worth retrying), or None when the answer is not such a wrapped refusal.
    """
    if status != 500 or len(body) > _MAX_WRAPPED_CHARS:
        return None
    text = body
    for _ in range(_MAX_WRAPPING + 1):
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        if isinstance(value, dict):
            return _refusal_status(value)
        if not isinstance(value, str) or not value.startswith("Hit an exception in "):
            return None
        at = value.find(_WRAPPED)
        if at < 0:
            return None
        inner = value[at + len(_WRAPPED) :].strip()
        if inner[:2] in ("b'", 'b"'):
            try:
                literal = ast.literal_eval(inner)  # a bytes literal only: nothing is evaluated
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return None
            if not isinstance(literal, bytes):
                return None
            inner = literal.decode("utf-8", errors="replace")
        text = inner
    return None


def _refusal_status(error: Mapping[str, Any]) -> int | None:
    """The 4xx of an error body: vLLM's ``{"object": "error", "code": 400}``, OpenAI's
    ``{"error": {"type": "invalid_request_error"}}``, FastAPI's ``{"detail": [{loc, msg}, ...]}``."""
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 500 and code not in (408, 429):
        return code
    nested = error.get("error")
    if isinstance(nested, Mapping) and nested.get("type") == "invalid_request_error":
        return 400
    detail = error.get("detail")
    if isinstance(detail, list) and detail and all(isinstance(d, Mapping) and "loc" in d for d in detail):
        return 422
    return None
