"""Native multi-turn rollouts: the bridge drives a generator and an environment directly.

:func:`run_episode` plays one rollout without an agent server and returns the **same result shape
as** ``POST /run`` of gymbridge's ``SimpleAgent`` (tool style or gymnasium style), so one
postprocessor (``from_gym_result``) serves both paths. :func:`run_group` runs G rollouts of one row
concurrently, batching their model calls, and records a failed rollout as data (``mask_sample``,
``failure_kind``, ``failure_reason``) instead of raising through the group.

Invariants:

* **the refresh rule**: every model call's input is rebuilt from the current conversation by
  :meth:`ChatCodec.render` (the previous call's tokens as the exact prefix) over an append-only
  :class:`ConversationHistory`, so turn k's input holds all tokens and **all media so far**; a
  prompt that does not extend the previous one, or media that are not the previous media plus new
  ones, raise ``TrajectoryError``;
* every HTTP call to the environment has a deadline (``timeout_s``); environment failures are
  ``EnvError`` subclasses (``EnvSessionLostError``; ``EnvFaultError`` for a fault mid-episode, a
  rollout of class ``env_fault``, never trained);
* only the tools the row offers are ever called, never a protocol route; bodies nested deeper than
  ``gymbridge.limits.MAX_JSON_DEPTH`` are ``ProtocolError`` s.

``forced_first_call`` and ``withhold_token_ids`` (a debugging control) are off by default; what
they do: docs/generation.md, "Native rollouts".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import httpx

from gymbridge.errors import (
    EnvServerError,
    EnvSessionLostError,
    EnvTimeoutError,
    EnvTransportError,
    GymbridgeError,
    ProtocolError,
    TrajectoryError,
)
from gymbridge.faults import env_fault, status_fault_kind
from gymbridge.generation.batching import BatchingGenerator, needs_batching
from gymbridge.generation.chat import ChatCodec, responses_to_messages, responses_tools_to_chat
from gymbridge.generation.outputs import response_items
from gymbridge.generation.tool_calls import mark_unparsed
from gymbridge.generation.types import ContextLengthError, Generator, SamplingConfig
from gymbridge.limits import check_json_depth, loads_json
from gymbridge.server._base import ERROR_HEADER, SESSION_LOST
from gymbridge.server._episode import (
    GymnasiumEpisode,
    ToolEpisode,
    offered_tool_names,
    tool_call_request,
    tool_output_items,
)
from gymbridge.server._tools import PARTS_HEADER
from gymbridge.trajectory.refresh import ConversationHistory, build_generation_input

if TYPE_CHECKING:
    from gymbridge.media import MediaPolicy

logger = logging.getLogger(__name__)

__all__ = ["EpisodeMode", "NativeModel", "row_sampling", "run_episode", "run_group"]

EpisodeMode = Literal["auto", "tools", "gymnasium"]


def row_sampling(rcp: Mapping[str, Any], default_max_tokens: int) -> SamplingConfig:
    """The row's ``temperature`` / ``top_p`` / ``max_output_tokens``; a bad value is ``ProtocolError``."""
    values: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "max_tokens": default_max_tokens}
    for key, field in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_output_tokens", "max_tokens"),
    ):
        value = rcp.get(key)
        if value is None:
            continue
        integral = field == "max_tokens"
        if isinstance(value, bool) or not isinstance(value, int if integral else int | float):
            raise ProtocolError(
                f"responses_create_params.{key} must be {'an integer' if integral else 'a number'}"
            )
        values[field] = value if integral else float(value)
    try:
        return SamplingConfig(**values)
    except ValueError as exc:
        raise ProtocolError(f"responses_create_params: {exc}") from exc


class NativeModel:
    """One rollout's model side: renders the conversation, checks the refresh rule, generates.

    ``inputs`` records every :class:`GenerationInput` handed to the generator (tests
    and debugging read it).
    """

    def __init__(
        self,
        generator: Generator,
        codec: ChatCodec,
        *,
        max_model_len: int,
        media_policy: MediaPolicy | None = None,
        sampling: SamplingConfig | None = None,
        default_max_tokens: int = 1024,
        withhold_token_ids: Sequence[int] | None = None,
        forced_first_call: Sequence[int] | None = None,
    ) -> None:
        self.generator = generator
        self.forced_first_call = list(forced_first_call) if forced_first_call is not None else None
        self.codec = codec
        self.max_model_len = max_model_len
        self.media_policy = media_policy
        self.sampling = sampling
        self.default_max_tokens = default_max_tokens
        self.history = ConversationHistory()
        self.inputs: list[Any] = []
        self.withhold_token_ids = frozenset(withhold_token_ids) if withhold_token_ids is not None else None
        self._stale: ConversationHistory | None = None
        """The generator's own view under the stale-prompt control (module docstring)."""

    def _sampling_for(self, rcp: Mapping[str, Any], prompt_len: int) -> SamplingConfig:
        base = self.sampling if self.sampling is not None else row_sampling(rcp, self.default_max_tokens)
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise ContextLengthError(prompt_tokens=prompt_len, max_model_len=self.max_model_len)
        return base if base.max_tokens <= room else base.with_max_tokens(room)

    def _advance(self, prompt: list[int], media: list[Any]) -> Any:
        seen, seen_media = self.history.token_ids, self.history.media
        if prompt[: len(seen)] != seen:
            raise TrajectoryError(
                f"the rendered prompt ({len(prompt)} tokens) does not extend the conversation so far "
                f"({len(seen)} tokens): the refresh rule would be broken"
            )
        if len(media) < len(seen_media) or any(
            a.key != b.key for a, b in zip(media, seen_media, strict=False)
        ):
            raise TrajectoryError("the conversation's media are not the previous media plus new ones")
        delta, new_media = prompt[len(seen) :], media[len(seen_media) :]
        self.history.append(delta, new_media)
        if self.withhold_token_ids is None:
            return build_generation_input(self.history)
        if self._stale is None:  # the first call's prompt: as it is, media included
            self._stale = ConversationHistory()
            self._stale.append(delta, new_media)
        else:  # later media withheld, with their placeholder tokens
            drop = self.withhold_token_ids if new_media else frozenset()
            self._stale.append([t for t in delta if t not in drop])
        return build_generation_input(self._stale)

    async def respond(self, rcp: Mapping[str, Any], items: list[Any]) -> dict[str, Any]:
        """One model call over ``items``; a Responses object with token fields on its last item."""
        tools = responses_tools_to_chat(rcp.get("tools"))
        metadata = rcp.get("metadata") if isinstance(rcp.get("metadata"), Mapping) else None

        def render() -> tuple[list[int], list[Any]]:
            messages = responses_to_messages(
                items, instructions=rcp.get("instructions"), metadata=metadata, policy=self.media_policy
            )
            rendered = self.codec.render(messages, tools)
            return rendered.prompt_token_ids, rendered.media

        prompt, media = await asyncio.to_thread(render)
        base: dict[str, Any] = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "model": str(rcp.get("model") or getattr(self.generator, "model_name", "gymbridge-native")),
            "parallel_tool_calls": True,
            "tool_choice": rcp.get("tool_choice", "auto"),
            "tools": rcp.get("tools") or [],
        }
        try:
            sampling = self._sampling_for(rcp, len(prompt))
        except ContextLengthError as exc:
            logger.info("native rollout: %s", exc)
            return base | {
                "status": "incomplete",
                "incomplete_details": {"reason": "max_output_tokens"},
                "output": [],
            }
        inp = await asyncio.to_thread(self._advance, prompt, media)
        self.inputs.append(inp)
        if self.forced_first_call is not None and len(self.inputs) == 1:
            gen = (await _scorer(self.generator).score([inp], [self.forced_first_call], sampling))[0]
        else:
            gen = (await self.generator.generate([inp], sampling))[0]
        self.history.append(gen.token_ids)
        if self._stale is not None:
            self._stale.append(gen.token_ids)
        parsed = self.codec.parse(gen.token_ids, tools)
        items_out = response_items(parsed, gen, prompt)
        mark_unparsed(items_out, parsed.unparsed_tool_calls)
        incomplete = gen.finish_reason == "length"
        usage = {"input_tokens": len(prompt), "output_tokens": len(gen.token_ids)}
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        return base | {
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": items_out,
            "usage": usage,
        }


def _scorer(generator: Any) -> Any:
    """The generator (or the one a batching wrapper holds) that can ``score`` forced tokens."""
    while not hasattr(generator, "score"):
        inner = getattr(generator, "inner", None)
        if inner is None:
            raise TrajectoryError(
                f"forced_first_call needs a generator with score(); {type(generator).__name__}"
            )
        generator = inner
    return generator


class _Env:
    """HTTP calls to one environment session (own cookie jar), each with a deadline."""

    def __init__(self, base_url: str, timeout_s: float, transport: httpx.AsyncBaseTransport | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, transport=transport)

    async def post(self, path: str, payload: Any, *, ok_only: bool = True) -> httpx.Response:
        try:
            content = json.dumps(check_json_depth(payload, f"POST {path} payload"), allow_nan=False)
        except ValueError as exc:
            raise ProtocolError(f"POST {path}: the payload holds NaN or infinity: {exc}") from exc
        try:
            reply = await self.client.post(
                path, content=content, headers={"content-type": "application/json"}
            )
        except httpx.TimeoutException as exc:
            raise EnvTimeoutError(f"POST {path} timed out", server=self.base_url) from exc
        except httpx.HTTPError as exc:
            reached = not isinstance(exc, httpx.ConnectError)
            raise EnvTransportError(
                f"POST {path} failed: {type(exc).__name__}: {exc}", server=self.base_url, reached=reached
            ) from exc
        if reply.status_code == 409 and reply.headers.get(ERROR_HEADER) == SESSION_LOST:
            raise EnvSessionLostError(
                f"POST {path}: the environment no longer knows this rollout's session "
                f"(restarted or evicted): {reply.text[:300]}",
                status=409,
                body=reply.text[:4000],
                server=self.base_url,
            )
        if ok_only and reply.status_code >= 400:
            raise EnvServerError(
                f"POST {path} answered HTTP {reply.status_code}: {reply.text[:300]}",
                status=reply.status_code,
                body=reply.text[:4000],
                server=self.base_url,
            )
        return reply

    async def post_json(self, path: str, payload: Any) -> Any:
        reply = await self.post(path, payload)
        try:
            return loads_json(reply.content, f"POST {path} answer")
        except ProtocolError as exc:
            raise EnvServerError(
                f"POST {path} answered a non-JSON or too deeply nested body: {exc}",
                status=reply.status_code,
                body=reply.text[:4000],
                server=self.base_url,
            ) from exc

    async def aclose(self) -> None:
        await self.client.aclose()


async def _tool_items(
    env: _Env, call: Mapping[str, Any], offered: frozenset[str], tool_media: str
) -> list[dict[str, Any]]:
    """The items a tool call adds: its output (and its media in a user message, by default).

    Only a tool the row offers is posted (:func:`~gymbridge.server._episode.tool_call_request`)."""
    request = tool_call_request(call, offered)
    if isinstance(request, list):
        return request
    name, arguments = request
    route = f"/{name}"
    try:
        reply = await env.post(route, arguments, ok_only=False)
    except (EnvTimeoutError, EnvTransportError) as exc:
        raise env_fault(route, tool=name, error=exc, server=env.base_url) from exc
    if status_fault_kind(reply.status_code) is not None:
        raise env_fault(route, tool=name, status=reply.status_code, body=reply.text, server=env.base_url)
    return tool_output_items(call.get("call_id"), reply.content, reply.headers.get(PARTS_HEADER), tool_media)


async def _step(env: _Env, body: dict[str, Any]) -> Any:
    """``POST /step``: its JSON answer; a broken call or a fault status is an :class:`EnvFaultError`."""
    try:
        return await env.post_json("/step", body)
    except (EnvTimeoutError, EnvTransportError) as exc:
        raise env_fault("/step", error=exc, server=env.base_url) from exc
    except EnvServerError as exc:
        if status_fault_kind(exc.status) is None:
            raise
        raise env_fault("/step", status=exc.status, body=exc.body, server=env.base_url) from exc


async def run_episode(
    generator: Generator,
    env: str,
    row: Mapping[str, Any],
    *,
    max_turns: int = 8,
    mode: EpisodeMode = "auto",
    codec: ChatCodec | None = None,
    sampling: SamplingConfig | None = None,
    media_policy: MediaPolicy | None = None,
    max_model_len: int | None = None,
    default_max_tokens: int = 1024,
    tool_media: Literal["message", "output"] = "message",
    timeout_s: float = 60.0,
    transport: httpx.AsyncBaseTransport | None = None,
    model: NativeModel | None = None,
    withhold_token_ids: Sequence[int] | None = None,
    forced_first_call: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Play one rollout of ``row`` against the environment at ``env`` (a base URL); see the module docstring.

    ``mode="auto"`` plays tool style when the row offers tools, gymnasium style
    (``/reset`` + ``/step``) otherwise. ``sampling`` (default: the row's
    ``temperature`` / ``top_p`` / ``max_output_tokens``) applies to every call.
    Pass ``model`` to inspect the inputs afterwards (``model.inputs``).
    ``withhold_token_ids``: the stale-prompt control; ``forced_first_call``: the forced first
    call (module docstring).
    """
    if max_turns < 1:
        raise ValueError("max_turns must be >= 1")
    check_json_depth(row, "the row")
    rcp = row.get("responses_create_params")
    if not isinstance(rcp, Mapping):
        raise TrajectoryError("the row has no responses_create_params object")
    if model is None:
        codec = codec if codec is not None else getattr(generator, "codec", None)
        if not isinstance(codec, ChatCodec):
            raise ValueError("run_episode needs a ChatCodec: pass codec= or use a generator with .codec")
        limit: Any = max_model_len or getattr(generator, "max_model_len", 4096)
        model = NativeModel(
            generator,
            codec,
            max_model_len=int(limit),
            media_policy=media_policy,
            sampling=sampling,
            default_max_tokens=default_max_tokens,
            withhold_token_ids=withhold_token_ids,
            forced_first_call=forced_first_call,
        )
    if mode == "auto":
        mode = "tools" if rcp.get("tools") else "gymnasium"
    session = _Env(env, timeout_s, transport)
    try:
        if mode == "tools":
            return await _run_tools(session, model, dict(row), dict(rcp), max_turns, tool_media)
        return await _run_gymnasium(session, model, dict(row), dict(rcp), max_turns)
    finally:
        await session.aclose()


async def _run_tools(
    env: _Env, model: NativeModel, row: dict[str, Any], rcp: dict[str, Any], max_turns: int, tool_media: str
) -> dict[str, Any]:
    await env.post_json("/seed_session", row)
    try:
        episode = ToolEpisode(rcp)
    except ProtocolError as exc:
        raise TrajectoryError(str(exc)) from None
    offered = offered_tool_names(rcp)
    for turn in range(1, max_turns + 1):
        calls = episode.add_response(await model.respond(rcp, episode.model_input()))
        if calls is None:
            break
        for call in calls:
            episode.outputs.extend(await _tool_items(env, call, offered, tool_media))
        if turn >= max_turns:
            episode.stop_at_max_steps()
    response = episode.response()
    result = await env.post_json("/verify", {**row, "response": response})
    if not isinstance(result, dict) or not isinstance(result.get("reward"), int | float):
        raise EnvServerError("/verify answered without a numeric reward", status=200, body=str(result)[:4000])
    return result


async def _run_gymnasium(
    env: _Env, model: NativeModel, row: dict[str, Any], rcp: dict[str, Any], max_turns: int
) -> dict[str, Any]:
    try:
        episode = GymnasiumEpisode({**row, "responses_create_params": rcp})
    except ProtocolError as exc:
        raise TrajectoryError(str(exc)) from None
    reset = await env.post_json("/reset", row)
    try:
        episode.start(reset)
    except ProtocolError as exc:
        raise EnvServerError(
            f"/reset answered an invalid body: {exc}", status=200, body=str(reset)[:4000]
        ) from None
    try:
        for _ in range(max_turns):
            last = await model.respond(rcp, episode.model_input())
            step_body = episode.add_response(last)
            if episode.context_exhausted:
                break
            step = await _step(env, step_body)
            try:
                if episode.add_step(step).done:
                    break
            except ProtocolError as exc:
                raise EnvServerError(
                    f"/step answered an invalid body: {exc}", status=200, body=str(step)[:4000]
                ) from None
    finally:
        if episode.supports_close:
            try:
                await env.post("/close", {})
            except GymbridgeError:
                logger.exception("closing the environment failed")
    return episode.result()


async def run_group(
    generator: Generator,
    env: str,
    row: Mapping[str, Any],
    *,
    num_rollouts: int,
    max_batch_size: int = 64,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """``num_rollouts`` concurrent :func:`run_episode` s of ``row``, model calls batched.

    Each result carries ``_ng_rollout_index``. A rollout that fails with a
    ``GymbridgeError`` becomes a record with ``mask_sample: True``, ``reward: 0.0``,
    ``failure_kind`` (the error class) and ``failure_reason`` (its message).
    """
    if num_rollouts < 1:
        raise ValueError("num_rollouts must be >= 1")
    owned = BatchingGenerator(generator, max_batch_size=max_batch_size) if needs_batching(generator) else None
    batched: Generator = owned if owned is not None else generator
    if kwargs.get("codec") is None:
        kwargs["codec"] = getattr(generator, "codec", None)
    if kwargs.get("max_model_len") is None:
        kwargs["max_model_len"] = getattr(generator, "max_model_len", None)

    async def one(i: int) -> dict[str, Any]:
        r = {**row, "_ng_rollout_index": i}
        try:
            return await run_episode(batched, env, r, **kwargs)
        except GymbridgeError as exc:
            logger.warning("rollout %d failed: %s: %s", i, type(exc).__name__, exc)
            return {
                **r,
                "response": {"output": [], "status": "failed"},
                "reward": 0.0,
                "mask_sample": True,
                "failure_kind": type(exc).__name__,
                "failure_reason": str(exc),
            }

    try:
        return list(await asyncio.gather(*(one(i) for i in range(num_rollouts))))
    finally:
        if owned is not None:
            await owned.aclose()
