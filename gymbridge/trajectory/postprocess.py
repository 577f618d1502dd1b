"""Gym ``/run`` result -> :class:`~gymbridge.trajectory.Trajectory`, in one walk.

:func:`from_gym_result` reads a verify result (row echo + ``response`` + ``reward``) and returns
its per-turn trainable segments (docs/design.md, "Trajectories"). It also reads genuine 0.7.0
shapes: a transitions-form ``output`` (:func:`_flatten_transitions`) and the compaction agent's
``response.media_assets`` (:func:`_check_media_assets`).

Invariants (each failure a ``TrajectoryError`` naming the output item when there is one):

* **one predicate, one place**: an output item is a turn exactly when it carries a non-empty
  ``generation_token_ids`` (:func:`_is_trainable`); every other item is context;
* token fields come all three or none, with as many logprobs as tokens; ids are non-negative ints;
  logprobs, reward and reward components are finite (``reward_components_check="sum"`` also
  makes the components sum to ``reward``); ``routed_experts`` align with the turn's tokens;
* **token bookkeeping**: each prompt must extend the tokens seen so far (``on_noncontiguous``:
  ``"error"``, or ``"split"`` into a new segment carrying the whole prompt and all media so far);
* **per-turn media**: each turn takes the media that arrived since the previous one; nothing is
  fetched or decoded here (lazy, policy-checked ``MediaItem.from_ref`` references);
* what belongs to no turn (trailing media, trailing assistant items) is counted in
  ``Trajectory.metadata``, never dropped without a trace.

The rules in full: docs/trajectory.md, "The rules".
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import numpy as np
import orjson
from pydantic import BaseModel

from gymbridge.errors import MediaError, ProtocolError, TrajectoryError
from gymbridge.media import MediaItem, MediaPolicy
from gymbridge.protocol import (
    MediaRef,
    media_ref_of_part,
    media_refs_of_content,
    media_refs_of_tool_output,
    metadata_audio_refs,
)
from gymbridge.trajectory.checks import check_media_placeholders
from gymbridge.trajectory.types import Trajectory, Turn, TurnKind

__all__ = ["MISSING_ROUTE", "OnNoncontiguous", "RewardComponentsCheck", "from_gym_result"]

logger = logging.getLogger(__name__)

OnNoncontiguous = Literal["error", "split"]
RewardComponentsCheck = Literal["sum", "off"]
MISSING_ROUTE = -1
"""The expert id of a ``routed_experts`` row the result did not carry (NeMo Gym's sentinel)."""

REWARD_SUM_TOLERANCE = 1e-6
"""Absolute tolerance for ``sum(reward_components) == reward``."""

_TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
_TURN_KINDS: frozenset[str] = frozenset(("message", "reasoning", "function_call"))
_TOOL_CALL_MARKUP = ("<tool_call>", "</tool_call>", "<function=")
_THINK_MARKUP = ("<think>", "</think>")


# ----------------------------------------------------------------------------- input


def _as_mapping(result: object) -> Mapping[str, Any]:
    if isinstance(result, Mapping):
        return result
    if isinstance(result, BaseModel):
        to_dict = getattr(result, "to_dict", None)
        if callable(to_dict):  # gymbridge.protocol wire models: the exact wire shape
            wire = to_dict()
            if isinstance(wire, dict):
                return wire
        # not exclude_unset: a model built in code may leave `type` to its default
        dumped: dict[str, Any] = result.model_dump(mode="json", by_alias=True)
        return dumped
    if isinstance(result, bytes | bytearray | memoryview | str):
        try:
            parsed = orjson.loads(result)
        except orjson.JSONDecodeError as exc:
            raise TrajectoryError(f"the result is not valid JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise TrajectoryError(f"the result JSON is a {type(parsed).__name__}, not an object")
        return parsed
    raise TypeError(
        f"from_gym_result takes a dict, JSON bytes/str or a pydantic model, not {type(result).__name__}"
    )


class _Tokens:
    """The validated token fields of one item."""

    __slots__ = ("generation", "logprobs", "prompt", "routes")

    def __init__(
        self,
        prompt: list[int],
        generation: list[int],
        logprobs: list[float],
        routes: list[list[list[int]]] | None = None,
    ) -> None:
        self.prompt = prompt
        self.generation = generation
        self.logprobs = logprobs
        self.routes = routes


def _check_token_ids(value: list[Any], name: str, index: int) -> None:
    """Every element a non-negative int < 2**64, checked at C speed by ``array('Q')``."""
    try:
        array("Q", value)
    except OverflowError as exc:
        raise TrajectoryError(
            f"{name} holds a negative or oversized token id: {exc}", item_index=index
        ) from exc
    except TypeError as exc:
        raise TrajectoryError(f"{name} must hold only ints: {exc}", item_index=index) from exc


def _int_list(value: object, name: str, index: int, *, check_items: bool = True) -> list[int]:
    if not isinstance(value, list):
        raise TrajectoryError(f"{name} must be a list of ints, got {type(value).__name__}", item_index=index)
    if check_items:
        _check_token_ids(value, name, index)
    return value


def _finite_floats(value: object, name: str, index: int) -> list[float]:
    if not isinstance(value, list):
        raise TrajectoryError(
            f"{name} must be a list of floats, got {type(value).__name__}", item_index=index
        )
    try:
        total = sum(array("d", value))
    except TypeError as exc:
        raise TrajectoryError(f"{name} must hold only numbers: {exc}", item_index=index) from exc
    if not math.isfinite(total):  # fast path; find the culprit only when something is off
        for position, x in enumerate(value):
            if not math.isfinite(x):
                raise TrajectoryError(f"{name}[{position}] is {x!r} (not finite)", item_index=index)
    return value


def _token_fields(item: Mapping[str, Any], index: int) -> _Tokens | None:
    """The item's token fields, validated; ``None`` when it carries none."""
    present = [name for name in _TOKEN_FIELDS if item.get(name) is not None]
    if not present:
        return None
    if len(present) != len(_TOKEN_FIELDS):
        missing = sorted(set(_TOKEN_FIELDS) - set(present))
        raise TrajectoryError(
            f"token fields partly present: has {', '.join(present)} but not {', '.join(missing)}",
            item_index=index,
        )
    # the prompt's elements are checked where it is used: only the part past the history is new
    prompt = _int_list(item["prompt_token_ids"], "prompt_token_ids", index, check_items=False)
    generation = _int_list(item["generation_token_ids"], "generation_token_ids", index)
    logprobs = _finite_floats(item["generation_log_probs"], "generation_log_probs", index)
    if len(logprobs) != len(generation):
        raise TrajectoryError(
            f"generation_log_probs has {len(logprobs)} values for {len(generation)} generated tokens",
            item_index=index,
        )
    raw_routes = item.get("routed_experts")
    routes = _routed_experts(raw_routes, index) if raw_routes is not None else None
    return _Tokens(prompt, generation, logprobs, routes)


_ROUTE_DTYPES = {"int8": "<i1", "int16": "<i2", "int32": "<i4"}


def _routed_experts(value: object, index: int) -> list[list[list[int]]]:
    """``routed_experts`` as ``[tokens][layers][topk]`` ints (nested lists, or the ``nrlre1`` envelope)."""
    if isinstance(value, str):
        return _decode_route_envelope(value, index)

    def bad(what: str) -> TrajectoryError:
        return TrajectoryError(f"routed_experts{what}", item_index=index)

    if not isinstance(value, list) or not value:
        raise bad(" must be a non-empty [tokens][layers][topk] list")
    shape: tuple[int, int] | None = None
    for position, row in enumerate(value):
        if not isinstance(row, list) or not row or not all(isinstance(layer, list) for layer in row):
            raise bad(f"[{position}] is not a [layers][topk] list")
        row_shape = (len(row), len(row[0]))
        shape = row_shape if shape is None else shape
        if row_shape != shape or any(len(layer) != shape[1] for layer in row):
            raise bad(f"[{position}] has another [layers][topk] shape than row 0 {shape}")
        for layer in row:
            if not all(isinstance(e, int) and not isinstance(e, bool) for e in layer):
                raise bad(f"[{position}] holds a non-integer expert id")
    return value


def _decode_route_envelope(text: str, index: int) -> list[list[list[int]]]:
    """NeMo Gym's ``nrlre1:<dtype>:<T>x<L>x<K>:<base64 little-endian ints>`` envelope."""
    parts = text.split(":", 3)
    dims = parts[2].split("x") if len(parts) == 4 else []
    if len(parts) != 4 or parts[0] != "nrlre1" or parts[1] not in _ROUTE_DTYPES or len(dims) != 3:
        raise TrajectoryError(
            "routed_experts string is not an nrlre1:<int8|int16|int32>:TxLxK:<base64> envelope: "
            f"{text[:40]!r}",
            item_index=index,
        )
    try:
        tokens, layers, topk = (int(d) for d in dims)
        raw = base64.b64decode(parts[3], validate=True)
    except (ValueError, binascii.Error) as exc:
        raise TrajectoryError(f"routed_experts envelope is malformed: {exc}", item_index=index) from exc
    dtype = np.dtype(_ROUTE_DTYPES[parts[1]])
    if min(tokens, layers, topk) <= 0 or len(raw) != tokens * layers * topk * dtype.itemsize:
        raise TrajectoryError(
            f"routed_experts envelope holds {len(raw)} bytes, not {tokens}x{layers}x{topk} {parts[1]} values",
            item_index=index,
        )
    decoded: list[list[list[int]]] = np.frombuffer(raw, dtype=dtype).reshape(tokens, layers, topk).tolist()
    return decoded


def _turn_routes(tokens: _Tokens, delta_len: int, index: int) -> list[list[list[int]]] | None:
    """The routes of one turn, one row per token of its prompt delta + generation."""
    routes = tokens.routes
    if routes is None:
        return None
    n_prompt, n_gen = len(tokens.prompt), len(tokens.generation)
    if len(routes) == n_prompt + n_gen:
        return routes[n_prompt - delta_len :]
    if len(routes) == n_gen:
        missing = [[MISSING_ROUTE] * len(routes[0][0]) for _ in routes[0]]
        return [[list(layer) for layer in missing] for _ in range(delta_len)] + routes
    raise TrajectoryError(
        f"routed_experts has {len(routes)} token rows; expected {n_prompt + n_gen} (prompt + generation) or "
        f"{n_gen} (generation only)",
        item_index=index,
    )


def _is_trainable(tokens: _Tokens | None) -> bool:
    """THE trainable predicate: an item is a turn iff it has a non-empty generation."""
    return tokens is not None and len(tokens.generation) > 0


def _finite_number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TrajectoryError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise TrajectoryError(f"{name} is {number!r} (not finite)")
    return number


def _optional_int(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TrajectoryError(f"{name} must be an int, got {value!r}")
    return value


def _texts(item: Mapping[str, Any]) -> list[str]:
    """The visible text of an assistant message (``output_text`` parts or a plain string)."""
    content = item.get("content")
    if isinstance(content, str):
        return [content]
    out: list[str] = []
    if isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    out.append(text)
    return out


# ----------------------------------------------------------------------------- walk


class _Walk:
    """State of the single pass over one result."""

    def __init__(self, policy: MediaPolicy | None, on_noncontiguous: OnNoncontiguous) -> None:
        self.policy = policy
        self.on_noncontiguous = on_noncontiguous
        self.pending_media: list[MediaItem] = []
        self.all_media: list[MediaItem] = []
        # assistant items of the model call in progress (its last item carries the tokens)
        self.invalid_tool_call = False
        self.malformed_thinking = False
        self.tool_names: list[str] = []
        self.untrained_items = 0  # assistant items since the last turn
        self.empty_generations = 0  # items with token fields but an empty generation (not turns)
        self.seen: list[int] = []
        self.segment = 0
        self.turns: list[Turn] = []

    # media ---------------------------------------------------------------
    def add_refs(self, refs: Sequence[MediaRef], item_index: int | None, where: str) -> None:
        for source, modality in refs:
            try:
                media = MediaItem.from_ref(source, modality, self.policy)
            except MediaError as exc:
                raise TrajectoryError(f"{where}: {modality} refused: {exc}", item_index=item_index) from exc
            self.pending_media.append(media)
            self.all_media.append(media)

    def collect(self, item: Mapping[str, Any], item_index: int | None, where: str) -> None:
        """Add the media of one non-assistant context item."""
        try:
            if item.get("type") == "function_call_output":
                refs = list(media_refs_of_tool_output(item.get("output")))
            else:
                refs = list(media_refs_of_content(item.get("content")))
        except ProtocolError as exc:
            raise TrajectoryError(f"{where}: {exc}", item_index=item_index) from exc
        if refs:
            self.add_refs(refs, item_index, where)

    # assistant items -------------------------------------------------------
    def note_assistant(self, item: Mapping[str, Any], kind: str) -> None:
        self.untrained_items += 1
        if kind == "function_call":
            name = item.get("name")
            if isinstance(name, str):
                self.tool_names.append(name)
        elif kind == "message":
            for text in _texts(item):
                if any(tag in text for tag in _TOOL_CALL_MARKUP):
                    self.invalid_tool_call = True
                if any(tag in text for tag in _THINK_MARKUP):
                    self.malformed_thinking = True

    # turns -----------------------------------------------------------------
    def turn(self, item: Mapping[str, Any], kind: TurnKind, tokens: _Tokens, index: int) -> None:
        prompt = tokens.prompt
        n_seen = len(self.seen)
        starts_new_segment = not self.turns
        if self.turns and (len(prompt) < n_seen or prompt[:n_seen] != self.seen):
            if self.on_noncontiguous == "error":
                raise TrajectoryError(
                    _noncontiguous_reason(self.seen, prompt, self.segment), item_index=index
                )
            self.segment += 1
            starts_new_segment = True
            logger.debug("output item %d: non-appending prompt, starting segment %d", index, self.segment)
        if starts_new_segment:
            _check_token_ids(prompt, "prompt_token_ids", index)
            delta = list(prompt)  # own copies: a frozen Turn must not alias the caller's dict
            # a fresh segment's prompt is the whole conversation: it owns every media so far
            media = list(self.all_media)
            self.seen = list(prompt)
        else:
            delta = prompt[n_seen:]  # the prefix equals the history, whose ids were checked already
            _check_token_ids(delta, "prompt_token_ids", index)
            media = self.pending_media
            self.seen.extend(delta)
        self.seen.extend(tokens.generation)
        routes = _turn_routes(tokens, len(delta), index)
        self.turns.append(
            Turn(
                index=len(self.turns),
                item_index=index,
                kind=kind,
                segment=self.segment,
                prompt_token_ids=delta,
                generation_token_ids=list(tokens.generation),
                generation_logprobs=list(tokens.logprobs),
                media=media,
                tool_name=_tool_name(item) if kind == "function_call" else None,
                tool_names=self.tool_names,
                invalid_tool_call=self.invalid_tool_call,
                malformed_thinking=self.malformed_thinking,
                policy_version=_policy_version(item, index),
                routed_experts=routes,
            )
        )
        self.pending_media = []
        self.untrained_items = 0
        self.tool_names = []
        self.invalid_tool_call = False
        self.malformed_thinking = False


def _policy_version(item: Mapping[str, Any], index: int) -> int | None:
    """The item's ``policy_version`` (a non-negative int) or ``None`` when absent."""
    value = item.get("policy_version")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TrajectoryError(f"policy_version must be a non-negative int, got {value!r}", item_index=index)
    return value


def _tool_name(item: Mapping[str, Any]) -> str | None:
    name = item.get("name")
    return name if isinstance(name, str) else None


def _noncontiguous_reason(seen: list[int], prompt: list[int], segment: int) -> str:
    first_diff = next((p for p, (a, b) in enumerate(zip(seen, prompt, strict=False)) if a != b), None)
    if first_diff is None:
        where = f"the prompt ({len(prompt)} tokens) is shorter than the history ({len(seen)} tokens)"
    else:
        where = f"first difference at token {first_diff} (history {len(seen)} tokens, prompt {len(prompt)})"
    return (
        f"non-contiguous prompt: prompt_token_ids does not extend the token history of segment {segment}: "
        f"{where}. The chat template may strip earlier reasoning, or the context was summarised or forked; "
        "pass on_noncontiguous='split' to train it as a new segment"
    )


def _item_kind(item: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """``(type, role)``; input messages may omit ``type``."""
    item_type = item.get("type")
    role = item.get("role")
    if item_type is None and role is not None:
        item_type = "message"
    return (item_type if isinstance(item_type, str) else None), (role if isinstance(role, str) else None)


def _is_context(item_type: str | None, role: str | None) -> bool:
    """A media-carrying context item: a tool output, or a message from anyone but the assistant.

    Beyond Gym's ``user`` / ``system`` / ``developer``, other roles (a chat-style ``tool``
    message an agent injected) are context too: their images must not be taken for
    assistant output and lost.
    """
    return item_type == "function_call_output" or (
        item_type == "message" and role is not None and role != "assistant"
    )


def _seed(
    walk: _Walk, data: Mapping[str, Any], response: Mapping[str, Any], output: list[Any], transitions: bool
) -> int:
    """Seed pending media from the initial input; returns how many output items repeat it."""
    params = data.get("responses_create_params")
    params = params if isinstance(params, Mapping) else {}
    agent_input = response.get("agent_input")
    seed_obs = response.get("seed_obs")
    if agent_input is not None:
        initial, source = agent_input, "response.agent_input"
    else:
        initial, source = params.get("input"), "responses_create_params.input"
    sources: list[tuple[str, object]] = [(source, initial)]
    if isinstance(seed_obs, list) and seed_obs:
        sources.append(("response.seed_obs", seed_obs))
    for name, items in sources:
        if isinstance(items, list):
            for position, item in enumerate(items):
                if isinstance(item, Mapping) and _is_context(*_item_kind(item)):
                    walk.collect(item, None, f"{name}[{position}]")
        elif items is not None and not isinstance(items, str):
            raise TrajectoryError(f"{name} must be a string or a list of items, got {type(items).__name__}")
    metadata = params.get("metadata")
    if isinstance(metadata, Mapping):
        try:
            audio_refs = metadata_audio_refs(metadata)
        except ProtocolError as exc:
            raise TrajectoryError(f"responses_create_params.metadata: {exc}") from exc
        walk.add_refs(audio_refs, None, "responses_create_params.metadata")
    candidates: list[object] = [seed_obs]
    if transitions and isinstance(initial, list):
        # a transition is the agent's whole input: it starts with the initial input itself
        candidates += [initial, initial + seed_obs if isinstance(seed_obs, list) else initial]
    return _echo_length(candidates, output)


def _echo_length(candidates: Sequence[object], output: Sequence[object]) -> int:
    """Length of the longest candidate item list that ``output`` repeats at its start (0 if none).

    Agents that prepend ``seed_obs`` (or, in transitions form, their whole initial input)
    to ``output`` must not count those media twice.
    """
    best = 0
    for candidate in candidates:
        if not (isinstance(candidate, list) and candidate) or len(output) < len(candidate):
            continue
        if all(
            isinstance(seed, Mapping)
            and isinstance(item, Mapping)
            and seed.get("role") == item.get("role")
            and seed.get("content") == item.get("content")
            and seed.get("output") == item.get("output")
            for seed, item in zip(candidate, output, strict=False)
        ):
            best = max(best, len(candidate))
    return best


def _flatten_transitions(output: list[Any]) -> tuple[list[Any], list[tuple[int, int]] | None]:
    """``response.output`` as one conversation; for transitions form also each item's origin.

    Agents run with ``return_transitions`` (aviary_agent, toolsandbox_agent) return one
    item list per step, each the agent's whole input at that step: the previous input
    (old environment states possibly collapsed to a placeholder, one item for one), then
    the model output, then the observation. So step ``t`` adds exactly the items past the
    length of step ``t - 1``; the items of every step are walked once, where they first
    appear, and a collapsed old observation never hides its media.
    """
    if not output or not all(isinstance(entry, list) for entry in output):
        if any(isinstance(entry, list) for entry in output):
            raise TrajectoryError(
                "response.output mixes items and transition lists; expected one form or the other"
            )
        return output, None
    flat: list[Any] = []
    origin: list[tuple[int, int]] = []
    previous = 0
    for step, transition in enumerate(output):
        if len(transition) < previous:
            raise TrajectoryError(
                f"response.output[{step}] (transitions form) has {len(transition)} items, fewer than the "
                f"{previous} of the step before; each transition must extend the previous one"
            )
        flat.extend(transition[previous:])
        origin.extend((step, position) for position in range(previous, len(transition)))
        previous = len(transition)
    return flat, origin


def from_gym_result(
    result: Mapping[str, Any] | bytes | str | BaseModel,
    *,
    media_policy: MediaPolicy | None = None,
    on_noncontiguous: OnNoncontiguous = "error",
    placeholder_token_ids: Mapping[str, int] | None = None,
    reward_components_check: RewardComponentsCheck = "off",
) -> Trajectory:
    """Turn one Gym ``/run`` result into a :class:`Trajectory` of per-turn trainable segments.

    ``result`` is the verify result as a dict, its JSON (bytes or str), or a pydantic
    model of it. ``media_policy`` is applied to every media reference (parsed and
    checked, never fetched). ``on_noncontiguous`` decides what a prompt that does not
    extend the token history does: ``"error"`` raises, ``"split"`` starts a new segment.
    ``placeholder_token_ids`` (modality -> placeholder token id), when given, also checks
    that every turn's media match the placeholders in its prompt delta
    (:func:`~gymbridge.trajectory.check_media_placeholders`).
    ``reward_components_check="sum"`` also requires ``reward_components`` to sum to
    ``reward``; the default ``"off"`` keeps them as given (``Trajectory.reward_components``).

    A transitions-form ``output`` (one item list per agent step, ``contains_transitions``)
    is walked as one conversation; item indices then count over that conversation and
    error messages also name ``response.output[step][position]``.

    Raises :class:`~gymbridge.errors.TrajectoryError` (with ``item_index`` naming the
    output item where there is one) when the result cannot be trained on.
    """
    if on_noncontiguous not in ("error", "split"):
        raise ValueError(f"on_noncontiguous must be 'error' or 'split', not {on_noncontiguous!r}")
    if reward_components_check not in ("sum", "off"):
        raise ValueError(f"reward_components_check must be 'sum' or 'off', not {reward_components_check!r}")
    data = _as_mapping(result)
    response = data.get("response")
    if not isinstance(response, Mapping):
        raise TrajectoryError("the result has no 'response' object")
    raw_output = response.get("output")
    if not isinstance(raw_output, list):
        raise TrajectoryError("response.output is missing or not a list")
    output, origin = _flatten_transitions(raw_output)

    walk = _Walk(media_policy, on_noncontiguous)
    skip_echo = _seed(walk, data, response, output, transitions=origin is not None)
    try:
        _walk_output(walk, output, skip_echo)
    except TrajectoryError as exc:
        if origin is None or exc.item_index is None:
            raise
        step, position = origin[exc.item_index]
        located = TrajectoryError(f"{exc} (response.output[{step}][{position}], transitions form)")
        located.item_index = exc.item_index
        raise located from exc.__cause__
    if not walk.turns:
        raise TrajectoryError(_no_turn_reason(walk, len(output)))
    _check_media_assets(response, walk)
    trajectory = _finish(walk, data, response, reward_components_check)
    if placeholder_token_ids is not None:
        check_media_placeholders(trajectory, placeholder_token_ids)
    return trajectory


def _check_media_assets(response: Mapping[str, Any], walk: _Walk) -> None:
    """Refuse a result whose ``media_assets`` images are not in its items (nothing silently lost).

    0.7.0's ``simple_agent_with_compaction`` lists every history image once in
    ``response.media_assets`` (``{media_id: {"source_part": <image part>, ...}}``). Its full
    response (``skip_verification``) keeps each image in its items too, so the walk placed it
    on a turn: trainable. Its transport projection strips image parts from ``response.output``:
    training it would pair image placeholders in the prompt tokens with no images.
    """
    assets = response.get("media_assets")
    if not isinstance(assets, Mapping) or not assets:
        return
    walked = {m.source for m in walk.all_media}
    missing = 0
    for asset in assets.values():
        part = asset.get("source_part") if isinstance(asset, Mapping) else None
        try:
            ref = media_ref_of_part(part) if isinstance(part, Mapping) else None
        except ProtocolError:
            ref = None
        if ref is None or ref[0] not in walked:
            missing += 1
    if missing:
        raise TrajectoryError(
            f"response.media_assets holds {len(assets)} media item(s), {missing} of them missing from the "
            "conversation (simple_agent_with_compaction's transport projection strips images from "
            "response.output); they cannot be placed per turn, so the turns would train image "
            "placeholders without images"
        )


def _walk_output(walk: _Walk, output: list[Any], skip_echo: int) -> None:
    """The one pass over the output items; ``_is_trainable`` decides what is a turn."""
    for index, item in enumerate(output):
        if not isinstance(item, Mapping):
            raise TrajectoryError(f"is a {type(item).__name__}, not an object", item_index=index)
        item_type, role = _item_kind(item)
        tokens = _token_fields(item, index)
        if _is_trainable(tokens):
            assert tokens is not None  # for mypy: _is_trainable checked it
            if item_type not in _TURN_KINDS or (item_type == "message" and role not in (None, "assistant")):
                raise TrajectoryError(
                    f"a {item_type!r} item (role {role!r}) carries generated tokens; only assistant "
                    "message, reasoning and function_call items can be trainable turns",
                    item_index=index,
                )
            walk.note_assistant(item, item_type)
            walk.turn(item, cast(TurnKind, item_type), tokens, index)
            continue
        if tokens is not None:
            walk.empty_generations += 1
        if _is_context(item_type, role):
            if index >= skip_echo:
                walk.collect(item, index, f"{item_type} item")
        elif item_type in _TURN_KINDS:
            walk.note_assistant(item, item_type)
        # any other item type is context that carries no media: passed over untouched


def _no_turn_reason(walk: _Walk, n_items: int) -> str:
    if walk.empty_generations:
        found = (
            f"{walk.empty_generations} item(s) carry token fields but every generation_token_ids is empty "
            "([]): the model generated nothing, or the agent replayed items whose token fields were "
            "blanked"
        )
    else:
        found = "none carries token fields: was the model server in training mode?"
    return (
        f"no trainable item among {n_items} output items ({found}). Likely causes: the prompt was longer "
        "than the model's context limit (nothing was generated), the model produced reasoning-only or "
        "empty output, or the model server was not in training mode (no token fields)"
    )


def _sampling(data: Mapping[str, Any], response: Mapping[str, Any]) -> dict[str, float]:
    """How the rollout was sampled: ``temperature`` / ``top_p`` as the response echoes them, else
    as its request (``responses_create_params``) asked, where a request without the field means
    the server's default (1.0); nothing when the result holds neither (the trainer then
    cannot check them)."""
    rcp = data.get("responses_create_params")
    out: dict[str, float] = {}
    for key in ("temperature", "top_p"):
        for source in (response, rcp if isinstance(rcp, Mapping) else {}):
            value = source.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out[key] = float(value)
                break
        else:
            if isinstance(rcp, Mapping):
                out[key] = 1.0
    return out


def _finish(
    walk: _Walk, data: Mapping[str, Any], response: Mapping[str, Any], components_check: RewardComponentsCheck
) -> Trajectory:
    if "reward" not in data:
        raise TrajectoryError("the result has no 'reward'")
    reward = _finite_number(data["reward"], "reward")
    components_raw = data.get("reward_components")
    components: dict[str, float] = {}
    if components_raw is not None:
        if not isinstance(components_raw, Mapping):
            raise TrajectoryError(f"reward_components must be an object, got {type(components_raw).__name__}")
        components = {
            str(name): _finite_number(value, f"reward_components[{name!r}]")
            for name, value in components_raw.items()
        }
        if (
            components_check == "sum"
            and components
            and not math.isclose(
                math.fsum(components.values()), reward, rel_tol=0.0, abs_tol=REWARD_SUM_TOLERANCE
            )
        ):
            raise TrajectoryError(
                f"reward_components sum to {math.fsum(components.values())!r} but reward is {reward!r} "
                f"(tolerance {REWARD_SUM_TOLERANCE}; reward_components_check='sum')"
            )
    mask_sample = data.get("mask_sample", False)
    if mask_sample is None:
        mask_sample = False
    if not isinstance(mask_sample, bool):
        raise TrajectoryError(f"mask_sample must be a bool, got {mask_sample!r}")

    incomplete = response.get("incomplete_details")
    response_meta = response.get("metadata")
    metadata: dict[str, Any] = {}
    if isinstance(response.get("id"), str):
        metadata["response_id"] = response["id"]
    if isinstance(incomplete, Mapping) and incomplete.get("reason") is not None:
        metadata["incomplete_reason"] = incomplete["reason"]
    if isinstance(response_meta, Mapping) and response_meta.get("ng_termination_reason") is not None:
        metadata["termination_reason"] = response_meta["ng_termination_reason"]
    sampling = _sampling(data, response)
    if sampling:
        metadata["sampling"] = sampling
    if walk.pending_media:
        metadata["trailing_media"] = len(walk.pending_media)
        logger.debug("%d media item(s) arrived after the last turn", len(walk.pending_media))
    if walk.untrained_items:
        # assistant output after the last turn without a generation: a model call whose tokens
        # were not captured (not in training mode) or that generated nothing
        metadata["trailing_assistant_items"] = walk.untrained_items
    truncated = (
        incomplete is not None or response.get("status") == "incomplete" or data.get("truncated") is True
    )

    failure_kind = data.get("failure_kind")
    failure_reason = data.get("failure_reason")
    return Trajectory(
        turns=walk.turns,
        reward=reward,
        reward_components=components,
        mask_sample=mask_sample,
        truncated=truncated,
        task_index=_optional_int(data.get("_ng_task_index"), "_ng_task_index"),
        rollout_index=_optional_int(data.get("_ng_rollout_index"), "_ng_rollout_index"),
        failure_class=str(failure_kind) if failure_kind is not None else None,
        failure_reason=str(failure_reason) if failure_reason is not None else None,
        metadata=metadata,
    )
