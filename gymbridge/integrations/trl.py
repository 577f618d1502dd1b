"""Train NeMo Gym environments with TRL's ``GRPOTrainer`` (TRL >= 1.16, ``pip install 'gymbridge[trl]'``).

Two paths, one per way TRL lets a rollout be owned (docs/integrations.md):

* **TRL owns the loop** — :func:`gym_environment` builds an ``environment_factory`` from any
  NeMo Gym resources server (a URL, or a :class:`~gymbridge.server.ResourcesServer` subclass
  served on loopback): ``reset(**row)`` posts the row to ``/seed_session`` (a fresh session per
  rollout); one method per Gym function tool, with the type hints and Google-style docstring
  TRL's schema builder reads; a tool's images come back as ``{"type": "image", "image": PIL}``
  blocks (TRL shows them to the model and trains on them); ``GymEnvironment.reward_func``
  posts the rollout to ``/verify`` in the same session (the environment's reward, never a
  re-implementation). Before training, :func:`check_tool_image_template` renders an image in a
  ``tool`` message with the processor's template and raises
  :class:`~gymbridge.errors.ChatTemplateMediaError` when the placeholders are missing (TRL would
  fail mid-run, or drop ``pixel_values`` for the whole batch without a word).
* **An agent owns the loop** — :func:`gym_rollout_func` is a ``rollout_func`` that posts every
  prompt TRL hands it to the agent's ``POST /run`` (any NeMo Gym agent, genuine ones included).
  TRL 1.16 repeats each dataset prompt ``num_generations`` times *before* calling it, so it runs
  exactly one rollout per prompt it gets and returns one row per prompt. ``env_mask`` comes from
  gymbridge's segments (1 on generated tokens). What TRL cannot train correctly is refused with
  :class:`~gymbridge.errors.UntrainableRolloutError`: media after the first model call (TRL's
  forward carries only the dataset prompt's images), a token history that does not only append
  (not one sequence), a first prompt with images that differs from TRL's own render of the
  dataset prompt (TRL takes the pixels from its render), a modality other than images.

:func:`trl_rows` turns Gym dataset rows into TRL rows: ``prompt`` (conversational, images as
``{"type": "image"}`` blocks where the Gym input had them), ``images`` (decoded under a
``MediaPolicy``) and the Gym row itself, JSON, on the first message under :data:`GYM_ROW_KEY`
(both paths read it from there: ``rollout_func`` receives prompts only).

Invariants: an environment session lives exactly from one ``reset`` to the next; only the tools
a row offers are posted (any other name answers stock Gym's ``{"detail": "Not Found"}``), never a
protocol route; a failed environment call is recorded in ``failures`` and scores ``None`` (TRL
then gives the rollout no advantage), and a batch where every rollout failed raises; a refusal is
raised, never turned into a silent text-only rollout. A tool's answer follows
:mod:`gymbridge.faults`: a 4xx or a 500 is the tool's own answer, shown to the model; a fault
(502 / 503 / 504 / 408 / 429, a broken connection, a timeout) fails the session. A result or
``/verify`` answer with ``mask_sample: true`` (its reward is not a measurement) is never trained:
recorded in ``failures``, scored ``None``, ``env_mask`` 0.
"""

from __future__ import annotations

import functools
import inspect
import json
import keyword
import logging
import operator
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import httpx
import orjson

from gymbridge.errors import (
    ChatTemplateMediaError,
    EnvError,
    EnvFaultError,
    EnvServerError,
    EnvTimeoutError,
    EnvTransportError,
    IntegrationError,
    ProtocolError,
    TrajectoryError,
    UntrainableRolloutError,
)
from gymbridge.integrations._common import (
    FlatRollout,
    ServerThread,
    flatten,
    masked_reason,
    require,
    run_sync,
)

if TYPE_CHECKING:
    from gymbridge.media import MediaPolicy
    from gymbridge.server import ResourcesServer

logger = logging.getLogger(__name__)

__all__ = [
    "GYM_ROW_KEY",
    "GymEnvironment",
    "GymRolloutFunc",
    "check_tool_image_template",
    "gym_environment",
    "gym_reward",
    "gym_rollout_func",
    "tool_method",
    "trl_rows",
]

GYM_ROW_KEY = "gym_row"
"""The key, on a TRL prompt's first message, holding the Gym row as JSON (:func:`trl_rows`)."""

_TRL_RESERVED = frozenset({"reset", "get_reward"})
_JSON_TYPES: dict[str, Any] = {"string": str, "integer": int, "number": float, "boolean": bool, "null": None}


def require_trl() -> Any:
    """Import ``trl`` or raise an ``ImportError`` naming ``gymbridge[trl]``."""
    return require("trl", "trl", "gymbridge.integrations.trl")


# ----------------------------------------------------------------------------- dataset rows


def trl_rows(
    gym_rows: Iterable[Mapping[str, Any]], *, media_policy: MediaPolicy | None = None
) -> list[dict[str, Any]]:
    """Gym dataset rows -> TRL dataset rows (``prompt``, ``images``; module docstring).

    Each row's ``responses_create_params.input`` becomes ``prompt`` (``instructions`` as a system
    message first); ``input_text`` parts become text blocks and ``input_image`` parts
    ``{"type": "image"}`` blocks in place, their images decoded into ``images`` in order. Audio
    and video parts are refused (:class:`UntrainableRolloutError`, ``unsupported_media``): TRL's
    VLM path carries images only.
    """
    from gymbridge.media import load_media
    from gymbridge.protocol import media_ref_of_part
    from gymbridge.server._episode import input_items

    out: list[dict[str, Any]] = []
    for index, row in enumerate(gym_rows):
        rcp = row.get("responses_create_params")
        if not isinstance(rcp, Mapping):
            raise ProtocolError(f"row {index}: no responses_create_params object")
        messages: list[dict[str, Any]] = []
        images: list[Any] = []
        instructions = rcp.get("instructions")
        if isinstance(instructions, str) and instructions:
            messages.append({"role": "system", "content": instructions})
        for item in input_items(rcp.get("input")):
            if not isinstance(item, Mapping) or item.get("type", "message") != "message":
                kind = item.get("type") if isinstance(item, Mapping) else type(item).__name__
                raise ProtocolError(
                    f"row {index}: input item of type {kind!r}; TRL prompts hold messages only"
                )
            role = "system" if item.get("role") == "developer" else str(item.get("role", "user"))
            content = item.get("content")
            if isinstance(content, str):
                messages.append({"role": role, "content": content})
                continue
            blocks: list[dict[str, Any]] = []
            for part in content if isinstance(content, list) else []:
                ref = media_ref_of_part(part) if isinstance(part, Mapping) else None
                if ref is not None:
                    source, modality = ref
                    if modality != "image":
                        raise UntrainableRolloutError(
                            f"dataset row {index} holds a {modality} part; TRL's prompts carry images only",
                            reason="unsupported_media",
                        )
                    images.append(load_media(source, "image", media_policy).image())
                    blocks.append({"type": "image"})
                elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    blocks.append({"type": "text", "text": part["text"]})
            messages.append({"role": role, "content": blocks})
        if not messages:
            raise ProtocolError(f"row {index}: responses_create_params.input holds no message")
        messages[0] = {**messages[0], GYM_ROW_KEY: orjson.dumps(dict(row)).decode()}
        out.append({"prompt": messages, "images": images})
    return out


def gym_row_of(columns: Mapping[str, Any]) -> dict[str, Any]:
    """The Gym row of a TRL row (its columns as ``reset`` gets them, or a prompt message list).

    The JSON under :data:`GYM_ROW_KEY` on the prompt's first message (:func:`trl_rows`), else a
    ``gym_row`` column, else the columns themselves less TRL's own (``prompt``, ``images``,
    ``image``, ``completion``).
    """
    prompt = columns.get("prompt")
    candidates = [
        prompt[0].get(GYM_ROW_KEY)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], Mapping)
        else None
    ]
    candidates.append(columns.get(GYM_ROW_KEY))
    for value in candidates:
        if isinstance(value, str):
            parsed = orjson.loads(value)
            if not isinstance(parsed, dict):
                raise ProtocolError(f"{GYM_ROW_KEY} holds a JSON {type(parsed).__name__}, not an object")
            return parsed
        if isinstance(value, Mapping):
            return dict(value)
    return {k: v for k, v in columns.items() if k not in ("prompt", "images", "image", "completion")}


def _prompt_row(prompt: Sequence[Mapping[str, Any]], index: int) -> dict[str, Any]:
    if not prompt or not isinstance(prompt[0], Mapping) or not isinstance(prompt[0].get(GYM_ROW_KEY), str):
        raise ProtocolError(
            f"prompt {index} carries no Gym row: build the dataset with gymbridge.integrations.trl.trl_rows "
            f"(the row's JSON goes on the first message under {GYM_ROW_KEY!r}; a rollout_func sees "
            "prompts only)"
        )
    return gym_row_of({"prompt": list(prompt)})


# ----------------------------------------------------------------------------- tools


def _hint(schema: Any) -> Any:
    """A Python type hint whose ``transformers.utils.get_json_schema`` rendering matches ``schema``."""
    if not isinstance(schema, Mapping):
        return Any
    enum = schema.get("enum")
    if (
        isinstance(enum, list)
        and enum
        and all(isinstance(v, str | int) and not isinstance(v, bool) for v in enum)
    ):
        literal: Any = Literal  # subscripted with values known at run time
        return literal[tuple(enum)]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return _union([_hint(o) for o in options])
    kind = schema.get("type")
    if isinstance(kind, list):
        return _union([_hint({**schema, "type": k}) for k in kind])
    if kind == "array":
        items: Any = _hint(schema.get("items")) if isinstance(schema.get("items"), Mapping) else Any
        return list[items]
    if kind == "object":
        return dict[str, Any]
    if kind in _JSON_TYPES:
        return type(None) if kind == "null" else _JSON_TYPES[kind]
    return Any


def _union(hints: list[Any]) -> Any:
    unique = list(dict.fromkeys(hints))
    return functools.reduce(operator.or_, unique)


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def tool_method(
    spec: Mapping[str, Any], call: Callable[[Any, str, dict[str, Any]], Any]
) -> Callable[..., Any]:
    """A method for one Gym function tool: ``call(self, name, arguments)`` does the work.

    ``spec`` is a Responses function tool (``{"type": "function", "name", "description",
    "parameters"}``) or a chat-style one (``{"type": "function", "function": {...}}``). The
    method's signature (keyword parameters with type hints; optional ones default to ``None``)
    and its Google-style docstring (``Args:`` with each parameter's description) are what
    ``transformers.utils.get_json_schema`` reads, so TRL renders the Gym schema's names, types,
    enums and descriptions; only the arguments the model gave are posted.
    """
    inner = spec.get("function")
    fn: Mapping[str, Any] = inner if isinstance(inner, Mapping) else spec
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"a function tool without a name: {dict(spec)!r}")
    if name.startswith("_") or name in _TRL_RESERVED:
        raise IntegrationError(
            f"tool {name!r}: TRL never treats a method named reset, get_reward or starting with '_' as a "
            "tool; rename the tool in the environment"
        )
    raw_params = fn.get("parameters")
    params: Mapping[str, Any] = raw_params if isinstance(raw_params, Mapping) else {}
    raw_properties = params.get("properties")
    properties: Mapping[str, Any] = raw_properties if isinstance(raw_properties, Mapping) else {}
    required = set(params.get("required") or [])
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    arg_docs: list[str] = []
    for pname, pschema in properties.items():
        if not str(pname).isidentifier() or pname == "self" or keyword.iskeyword(pname):
            raise IntegrationError(
                f"tool {name!r}: argument {pname!r} is not a Python identifier, so TRL's tool schema "
                "(built from a method signature) cannot name it"
            )
        hint = _hint(pschema)
        optional = pname not in required
        if optional:
            hint = _union([hint, type(None)])
        annotations[pname] = hint
        parameters.append(
            inspect.Parameter(
                pname,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=hint,
                default=None if optional else inspect.Parameter.empty,
            )
        )
        described = pschema.get("description") if isinstance(pschema, Mapping) else None
        arg_docs.append(f"    {pname}: {_one_line(described or f'the {pname} argument')}")
    description = _one_line(fn.get("description") or f"The {name} tool.")
    doc = description + ("\n\nArgs:\n" + "\n".join(arg_docs) + "\n" if arg_docs else "\n")

    def method(self: Any, **arguments: Any) -> Any:
        return call(self, name, arguments)

    method.__name__ = name
    method.__qualname__ = name
    method.__doc__ = doc
    method.__annotations__ = annotations
    method.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    return method


# ----------------------------------------------------------------------------- template check


def _image_token_id(processing_class: Any) -> int | None:
    token_id = getattr(processing_class, "image_token_id", None)
    if isinstance(token_id, int):
        return token_id
    token = getattr(processing_class, "image_token", None)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if isinstance(token, str):
        converted = tokenizer.convert_tokens_to_ids(token)
        return int(converted) if isinstance(converted, int) else None
    return None


def check_tool_image_template(
    processing_class: Any, *, chat_template_kwargs: Mapping[str, Any] | None = None
) -> int:
    """Check that a ``tool`` message's image becomes its placeholder tokens; return their count.

    Mirrors how TRL 1.16 builds a tool answer's tokens (``GRPOTrainer._get_tool_suffix_ids``: the
    template of a one-call conversation with and without the tool message, the training
    template when the processor's is not prefix-preserving) for one probe image, and compares the
    image placeholders in the difference with the image's features
    (``image_grid_thw / merge_size**2``). Raises :class:`ChatTemplateMediaError` when they differ:
    TRL would drop ``pixel_values`` for the whole batch. A processor without an
    ``image_processor`` (a text model) takes no tool images and returns 0.
    """
    if getattr(processing_class, "image_processor", None) is None:
        return 0
    require_trl()
    from PIL import Image
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving
    from trl.data_utils import prepare_multimodal_messages

    image_token_id = _image_token_id(processing_class)
    if image_token_id is None:
        raise ChatTemplateMediaError(
            "the processor names no image token (image_token / image_token_id): tool images cannot be placed",
            expected=1,
            found=0,
        )
    image = Image.new("RGB", (64, 64), (200, 30, 30))
    grid = processing_class.image_processor(images=[image], return_tensors="pt").get("image_grid_thw")
    merge = int(getattr(processing_class.image_processor, "merge_size", 2))
    expected = int(grid[0].prod().item()) // merge**2 if grid is not None else 1
    calls = [{"type": "function", "function": {"name": "probe", "arguments": {}}}]
    dummy: list[dict[str, Any]] = [
        {"role": "user", "content": "probe"},
        {"role": "assistant", "content": "", "tool_calls": calls},
    ]
    tool: list[dict[str, Any]] = [
        {
            "role": "tool",
            "name": "probe",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "probe"}],
        }
    ]
    template = (
        None
        if is_chat_template_prefix_preserving(processing_class)
        else get_training_chat_template(processing_class)
    )
    kwargs = dict(chat_template_kwargs or {})
    prefix = processing_class.apply_chat_template(
        prepare_multimodal_messages(dummy), add_generation_prompt=False, tokenize=True,
        chat_template=template, return_dict=False, **kwargs,
    )[0]  # fmt: skip
    failure: ValueError | None = None
    try:
        full = processing_class.apply_chat_template(
            prepare_multimodal_messages(dummy + tool), add_generation_prompt=True, tokenize=True,
            chat_template=template, return_dict=False, **kwargs,
        )[0]  # fmt: skip
        found = list(full[len(prefix) :]).count(image_token_id)
    except ValueError as exc:  # the processor's own count check: the image got no placeholder at all
        failure, found = exc, 0
    if found != expected:
        raise ChatTemplateMediaError(
            f"the chat template renders {found} image placeholder token(s) for an image in a tool message, "
            f"its features need {expected}: TRL would fail on, or silently drop, the pixel_values of "
            "every batch with a tool image. Use a template that renders the image parts of tool "
            "messages (between the tool response markers), e.g. set processing_class.chat_template "
            "to one that does" + (f" (the processor said: {failure})" if failure is not None else ""),
            expected=expected,
            found=found,
        )
    return found


# ----------------------------------------------------------------------------- environment_factory


@dataclass
class _ToolCall:
    name: str
    arguments: dict[str, Any]
    items: list[dict[str, Any]]
    """The Responses items the answer adds (as gymbridge's agent writes them)."""


@dataclass
class _Failure:
    kind: str
    reason: str
    row: dict[str, Any] | None = None

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, "reason": self.reason, "row": self.row}


class _GymEnvironmentBase:
    """One TRL rollout's environment session; the generated subclass adds one method per tool.

    Every attribute that is not a tool is private or not a function: TRL turns each public
    function of the class into a tool.
    """

    _owner: GymEnvironment

    def __init__(self) -> None:
        self._client: httpx.Client | None = None
        self._row: dict[str, Any] = {}
        self._offered: frozenset[str] = frozenset()
        self._calls: list[_ToolCall] = []
        self._failure: _Failure | None = None
        self._refusal: UntrainableRolloutError | None = None

    def reset(self, **row: Any) -> None:
        """Start a new Gym session for this dataset row (``POST /seed_session``)."""
        from gymbridge.server._episode import offered_tool_names

        owner = self._owner
        if self._client is not None:
            self._client.close()
        self._client = httpx.Client(base_url=owner.url, timeout=owner.timeout_s, trust_env=False)
        self._calls, self._failure, self._refusal = [], None, None
        self._row = gym_row_of(row)
        rcp = self._row.get("responses_create_params")
        offered = (
            offered_tool_names(rcp) if isinstance(rcp, Mapping) and rcp.get("tools") else owner.tool_names
        )
        self._offered = offered & owner.tool_names
        try:
            self._post("/seed_session", self._row)
        except EnvError as exc:
            self._fail("seed_session", exc)
        return None

    def _close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _fail(self, what: str, exc: BaseException) -> None:
        self._failure = _Failure(type(exc).__name__, f"{what}: {exc}", self._row)
        logger.warning("gym environment %s: %s failed: %s", self._owner.url, what, exc)

    def _post(self, path: str, payload: Any, *, tool: str | None = None) -> httpx.Response:
        """POST ``payload``; a tool's 4xx and 500 are its answer, its faults raise ``EnvFaultError``."""
        from gymbridge.faults import env_fault, status_fault_kind

        if self._client is None:
            raise RuntimeError("reset() was not called")
        try:
            try:
                reply = self._client.post(
                    path, content=json.dumps(payload), headers={"content-type": "application/json"}
                )
            except httpx.TimeoutException as exc:
                raise EnvTimeoutError(f"POST {path} timed out", server=self._owner.url) from exc
            except httpx.HTTPError as exc:
                raise EnvTransportError(
                    f"POST {path} failed: {exc}",
                    server=self._owner.url,
                    reached=not isinstance(exc, httpx.ConnectError),
                ) from exc
        except EnvError as exc:
            if tool is None:
                raise
            raise env_fault(path, tool=tool, error=exc, server=self._owner.url) from exc
        if tool is not None:
            if status_fault_kind(reply.status_code) is not None:
                raise env_fault(
                    path, tool=tool, status=reply.status_code, body=reply.text, server=self._owner.url
                )
            return reply
        if reply.status_code >= 400:
            raise EnvServerError(
                f"POST {path} answered HTTP {reply.status_code}: {reply.text[:300]}",
                status=reply.status_code,
                body=reply.text[:4000],
                server=self._owner.url,
            )
        return reply

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        from gymbridge.server._episode import tool_output_items
        from gymbridge.server._tools import PARTS_HEADER

        call_id = f"call_{uuid.uuid4().hex[:12]}"
        if self._failure is not None:
            return json.dumps({"error": f"the environment session failed: {self._failure.reason}"})
        if name not in self._offered:
            items = [
                {
                    "type": "function_call_output",
                    "call_id": call_id,
                    "output": json.dumps({"detail": "Not Found"}),
                }
            ]
            self._calls.append(_ToolCall(name, arguments, items))
            return items[0]["output"]
        try:
            reply = self._post(f"/{name}", arguments, tool=name)
        except EnvFaultError as exc:
            self._fail(f"tool {name}", exc)
            raise
        items = tool_output_items(call_id, reply.content, reply.headers.get(PARTS_HEADER), "message")
        self._calls.append(_ToolCall(name, arguments, items))
        return self._blocks(name, items)

    def _blocks(self, name: str, items: list[dict[str, Any]]) -> Any:
        """What TRL shows the model: the output text, plus image blocks when the answer had media."""
        from gymbridge.media import load_media
        from gymbridge.protocol import media_ref_of_part

        text = items[0]["output"]
        media = [p for item in items[1:] for p in item.get("content", []) if isinstance(p, Mapping)]
        if not media:
            return text
        blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        for part in media:
            ref = media_ref_of_part(part)
            if ref is None:
                continue
            source, modality = ref
            if modality != "image" or not self._owner.takes_images:
                self._refusal = UntrainableRolloutError(
                    f"tool {name!r} answered a {modality} part, which TRL's "
                    f"{'tool loop' if modality != 'image' else 'text-only processing class'} cannot carry",
                    reason="unsupported_media",
                )
                logger.error("%s", self._refusal)
                continue
            blocks.append(
                {"type": "image", "image": load_media(source, "image", self._owner.media_policy).image()}
            )
        return blocks

    def _verify(self, completion: Sequence[Mapping[str, Any]]) -> float | None:
        """Post this rollout to ``/verify`` in its session; ``None`` (recorded) when the episode failed."""
        if self._refusal is not None:
            raise self._refusal
        if self._failure is None:
            try:
                reward = self._verify_reward(completion)
            except (EnvError, ProtocolError) as exc:
                self._fail("verify", exc)
            else:
                if reward is not None:
                    return reward
        assert self._failure is not None
        self._owner.failures.append(self._failure.record())
        return None

    def _verify_reward(self, completion: Sequence[Mapping[str, Any]]) -> float | None:
        """``/verify``'s reward; ``None`` (the failure set) when it masked the sample."""
        from gymbridge import protocol as p

        rcp = self._row.get("responses_create_params")
        tools = rcp.get("tools") if isinstance(rcp, Mapping) and isinstance(rcp.get("tools"), list) else []
        output = completion_items(completion, self._calls)
        response = p.dump(
            p.Response.model_validate({"output": output, "model": self._owner.model_name, "tools": tools})
        )
        reply = self._post("/verify", {**self._row, "response": response})
        try:
            body = orjson.loads(reply.content)
        except orjson.JSONDecodeError as exc:
            raise ProtocolError(f"/verify answered non-JSON: {reply.text[:200]!r}") from exc
        reward = body.get("reward") if isinstance(body, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise ProtocolError(f"/verify answered without a numeric reward: {str(body)[:200]}")
        masked = masked_reason(body)
        if masked is not None:
            self._failure = _Failure("mask_sample", f"verify: {masked}", self._row)
            logger.warning("gym environment %s: /verify masked the sample: %s", self._owner.url, masked)
            return None
        return float(reward)


def completion_items(
    completion: Sequence[Mapping[str, Any]], calls: Sequence[_ToolCall]
) -> list[dict[str, Any]]:
    """TRL's completion messages -> Responses output items, each tool message as its recorded answer items.

    Assistant text becomes a ``message`` item, each of its tool calls a ``function_call`` item; the
    k-th ``tool`` message is replaced by the items of the k-th recorded call (its media as the
    data URLs the environment sent, not TRL's decoded images). Tool answers TRL rolled back
    (over ``max_completion_length``) are not in the completion and are left out.
    """
    from gymbridge import protocol as p

    items: list[dict[str, Any]] = []
    made = answered = 0
    for message in completion:
        role = message.get("role")
        if role == "assistant":
            content = message.get("content")
            text = (
                content
                if isinstance(content, str)
                else "".join(
                    str(b.get("text", ""))
                    for b in content or []
                    if isinstance(b, Mapping) and b.get("type") == "text"
                )
            )
            if text:
                items.append(
                    p.dump(p.AssistantMessage(content=[p.OutputTextPart(text=text)], status="completed"))
                )
            for tool_call in message.get("tool_calls") or []:
                function = tool_call.get("function", tool_call) if isinstance(tool_call, Mapping) else {}
                arguments = function.get("arguments", {})
                call_id = (
                    calls[made].items[0]["call_id"] if made < len(calls) else f"call_{uuid.uuid4().hex[:12]}"
                )
                made += 1
                items.append(
                    p.dump(
                        p.FunctionCallItem(
                            call_id=call_id,
                            name=str(function.get("name", "")),
                            arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
                            status="completed",
                        )
                    )
                )
        elif role == "tool" and answered < len(calls):
            items.extend(calls[answered].items)
            answered += 1
    return items


class GymEnvironment:
    """An ``environment_factory`` for TRL over one NeMo Gym resources server (see :func:`gym_environment`).

    ``env()`` returns a fresh environment instance (TRL pools and resets them);
    :attr:`reward_func` posts each rollout to ``/verify``; :attr:`failures` lists the records of
    failed rollouts (``kind``, ``reason``, ``row``); :meth:`close` stops a server this object
    started. Usable as a context manager.
    """

    def __init__(
        self,
        url: str,
        tools: Sequence[Mapping[str, Any]],
        *,
        takes_images: bool,
        media_policy: MediaPolicy | None = None,
        timeout_s: float = 60.0,
        model_name: str = "trl-policy",
        server: ServerThread | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.tools = [dict(t) for t in tools]
        self.takes_images = takes_images
        self.media_policy = media_policy
        self.timeout_s = timeout_s
        self.model_name = model_name
        self.failures: list[dict[str, Any]] = []
        self._server = server
        self._sessions: weakref.WeakSet[_GymEnvironmentBase] = weakref.WeakSet()
        methods = {}
        for spec in self.tools:
            method = tool_method(spec, _GymEnvironmentBase._call_tool)
            if method.__name__ in methods:
                raise IntegrationError(f"two tools are named {method.__name__!r}")
            methods[method.__name__] = method
        if not methods:
            raise IntegrationError(
                f"{self.url} offers no function tools: TRL's environment_factory plays tool-style "
                "environments; drive a gymnasium-style one through an agent with gym_rollout_func"
            )
        self.tool_names = frozenset(methods)
        self.environment_class: type[_GymEnvironmentBase] = type(
            "GymEnvironmentSession",
            (_GymEnvironmentBase,),
            {**methods, "_owner": self, "__module__": __name__},
        )
        self.reward_func = self._make_reward_func()

    def __call__(self) -> _GymEnvironmentBase:
        session = self.environment_class()
        self._sessions.add(session)
        return session

    def _make_reward_func(self) -> Callable[..., list[float | None]]:
        def gym_verify(
            completions: Sequence[Any], environments: Sequence[Any] | None = None, **_: Any
        ) -> list[float | None]:
            if environments is None:
                raise IntegrationError(
                    "gym_verify needs TRL's environments (pass this GymEnvironment as environment_factory)"
                )
            rewards = [
                env._verify(completion) for env, completion in zip(environments, completions, strict=True)
            ]
            if rewards and all(r is None for r in rewards):
                raise EnvError(
                    f"every rollout of the batch failed against {self.url}; "
                    f"last: {self.failures[-1]['reason']}",
                    server=self.url,
                )
            return rewards

        return gym_verify

    def close(self) -> None:
        """Close every session's HTTP client and stop a server this object started."""
        for session in list(self._sessions):
            session._close()
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> GymEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def gym_environment(
    server: str | type[ResourcesServer] | ResourcesServer,
    *,
    processing_class: Any,
    tools: Sequence[Mapping[str, Any]] | None = None,
    media_policy: MediaPolicy | None = None,
    timeout_s: float = 60.0,
) -> GymEnvironment:
    """An ``environment_factory`` (plus ``reward_func``) for TRL's ``GRPOTrainer`` over a NeMo Gym server.

    ``server`` is a base URL, a :class:`~gymbridge.server.ResourcesServer` subclass or instance
    (served on loopback from a daemon thread until :meth:`GymEnvironment.close`).
    ``processing_class`` is the one given to the trainer: when it has an image processor, its
    template is checked for images in tool messages now (:func:`check_tool_image_template`).
    ``tools`` (Responses function tools) default to the class's typed tools, else the server's
    ``GET /tools`` (gymbridge servers); a genuine NeMo Gym server publishes none, so pass the
    ``responses_create_params.tools`` of its rows.
    """
    require_trl()
    from gymbridge.server import ResourcesServer

    thread: ServerThread | None = None
    if isinstance(server, type) and issubclass(server, ResourcesServer):
        server = server()
    if isinstance(server, ResourcesServer):
        if tools is None:
            tools = type(server).function_tools()
        thread = ServerThread(server)
        url = thread.start()
    elif isinstance(server, str):
        url = server
    else:
        raise TypeError(f"server must be a URL or a ResourcesServer, not {type(server).__name__}")
    try:
        if tools is None:
            tools = _published_tools(url, timeout_s)
        takes_images = check_tool_image_template(processing_class) > 0
        return GymEnvironment(
            url,
            tools,
            takes_images=takes_images,
            media_policy=media_policy,
            timeout_s=timeout_s,
            server=thread,
        )
    except BaseException:
        if thread is not None:
            thread.stop()
        raise


def _published_tools(url: str, timeout_s: float) -> list[dict[str, Any]]:
    try:
        reply = httpx.get(f"{url.rstrip('/')}/tools", timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as exc:
        raise EnvTransportError(f"GET {url}/tools failed: {exc}", server=url) from exc
    if reply.status_code != 200:
        raise IntegrationError(
            f"{url} publishes no tools (GET /tools answered HTTP {reply.status_code}; genuine NeMo Gym "
            "servers have no such route): pass tools= (the responses_create_params.tools of its rows)"
        )
    tools = orjson.loads(reply.content)
    if not isinstance(tools, list):
        raise ProtocolError(f"GET {url}/tools answered a {type(tools).__name__}, not a list")
    return tools


# ----------------------------------------------------------------------------- rollout_func


def gym_reward(
    completions: Sequence[Any], gym_reward: Sequence[float | None] | None = None, **_: Any
) -> list[float | None]:
    """TRL reward function for :func:`gym_rollout_func`: each rollout's ``/verify`` reward (the agent's)."""
    if gym_reward is None:
        raise IntegrationError("gym_reward needs the gym_reward column that gym_rollout_func returns")
    return list(gym_reward)


@dataclass
class GymRolloutFunc:
    """A TRL ``rollout_func`` over a NeMo Gym agent's ``POST /run`` (see :func:`gym_rollout_func`)."""

    agent_url: str
    deadline_s: float = 900.0
    concurrency: int = 32
    max_attempts: int = 3
    media_policy: MediaPolicy | None = None
    transport: httpx.AsyncBaseTransport | None = None
    """An httpx transport for the agent calls (tests plug in ``httpx.MockTransport``)."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """One record per failed rollout (``kind``, ``reason``, ``row``): scored ``None``, no advantage."""
    rollouts: list[FlatRollout | None] = field(default_factory=list)
    """The last batch's rollouts, one per prompt (``None`` for a failed one)."""

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        rows = [_prompt_row(prompt, i) for i, prompt in enumerate(prompts)]
        seen: dict[bytes, int] = {}
        for row in rows:  # TRL repeats each prompt num_generations times: one rollout per copy
            key = orjson.dumps(row, option=orjson.OPT_SORT_KEYS)
            row.setdefault("_ng_rollout_index", seen.get(key, 0))
            seen[key] = seen.get(key, 0) + 1
        outcomes = run_sync(self._run(rows))
        processing_class = trainer.processing_class
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        eos = int(tokenizer.eos_token_id)
        out: dict[str, list[Any]] = {
            k: []
            for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "gym_reward", "gym_failure")
        }
        self.rollouts = []
        for i, (prompt, outcome) in enumerate(zip(prompts, outcomes, strict=True)):
            rendered = _trl_prompt_ids(prompt, trainer) if _has_images(prompt) else None
            masked = masked_reason(outcome.result)
            if outcome.result is None or masked is not None:
                kind, reason = (outcome.kind, outcome.reason) if masked is None else ("mask_sample", masked)
                record = {"kind": kind, "reason": reason, "row": rows[i]}
                self.failures.append(record)
                logger.warning("rollout %d failed (%s): %s", i, kind, reason)
                prompt_ids = rendered if rendered is not None else _text_prompt_ids(prompt, trainer)
                values: list[Any] = [prompt_ids, [eos], [0.0], [0], None, f"{kind}: {reason}"]
                self.rollouts.append(None)
            else:
                flat = _trainable(outcome.result, i, rendered, processing_class)
                self.rollouts.append(flat)
                values = [
                    flat.prompt_ids,
                    flat.response_ids,
                    flat.response_logprobs,
                    flat.response_mask,
                    flat.reward,
                    None,
                ]
            for column, value in zip(out, values, strict=True):
                out[column].append(value)
        if outcomes and all(o.result is None for o in outcomes):
            raise EnvError(
                f"every rollout of the batch failed at {self.agent_url}; last: {outcomes[-1].reason}",
                server=self.agent_url,
            )
        return out

    async def _run(self, rows: list[dict[str, Any]]) -> list[Any]:
        from gymbridge.client import GymClient

        async with GymClient(
            self.agent_url,
            deadline_s=self.deadline_s,
            max_attempts=self.max_attempts,
            transport=self.transport,
        ) as client:
            got = [o async for o in client.run_many(rows, concurrency=self.concurrency, progress=False)]
        return sorted(got, key=lambda o: o.index)


def gym_rollout_func(
    agent_url: str,
    *,
    deadline_s: float = 900.0,
    concurrency: int = 32,
    max_attempts: int = 3,
    media_policy: MediaPolicy | None = None,
) -> GymRolloutFunc:
    """A TRL ``rollout_func`` that runs every prompt through the agent at ``agent_url`` (module docstring).

    Use with ``reward_funcs=[gym_reward]`` and a dataset built by :func:`trl_rows`; the agent's
    model server must serve the policy TRL trains (e.g. TRL's vLLM server, or gymbridge's model
    server over the same model object). Each call returns, per prompt: ``prompt_ids`` (the
    first model call's prompt), ``completion_ids`` (everything after it), ``logprobs``,
    ``env_mask`` and the extra columns ``gym_reward`` / ``gym_failure``.
    """
    require_trl()
    return GymRolloutFunc(
        agent_url.rstrip("/"),
        deadline_s=deadline_s,
        concurrency=concurrency,
        max_attempts=max_attempts,
        media_policy=media_policy,
    )


def _has_images(prompt: Sequence[Mapping[str, Any]]) -> bool:
    return any(
        isinstance(block, Mapping) and block.get("type") == "image"
        for message in prompt
        if isinstance(message.get("content"), list)
        for block in message["content"]
    )


def _trl_prompt_ids(prompt: Sequence[Mapping[str, Any]], trainer: Any) -> list[int]:
    """The prompt's token ids as TRL 1.16 renders it for the forward's pixels (``forward_kwargs``)."""
    from trl.data_utils import apply_chat_template

    processing_class = trainer.processing_class
    tools = list(getattr(trainer, "tools", None) or []) or None
    kwargs = dict(getattr(trainer, "chat_template_kwargs", None) or {})
    example: dict[str, Any] = {"prompt": list(prompt)}
    text = apply_chat_template(example, processing_class, tools=tools, **kwargs)["prompt"]
    images = [
        b["image"]
        for m in prompt
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, Mapping) and b.get("type") == "image"
    ]
    encoded = processing_class(images=images, text=[text], padding=True, return_tensors="pt")
    return [int(t) for t in encoded["input_ids"][0].tolist()]


def _text_prompt_ids(prompt: Sequence[Mapping[str, Any]], trainer: Any) -> list[int]:
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    ids = tokenizer.apply_chat_template(
        list(prompt), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return [int(t) for t in (ids[0] if ids and isinstance(ids[0], list) else ids)]


def _trainable(
    result: Mapping[str, Any], row: int, rendered: list[int] | None, processing_class: Any
) -> FlatRollout:
    """One ``/run`` result as TRL's row, or the refusal of what TRL cannot train (module docstring)."""
    from gymbridge.trajectory import from_gym_result

    image_token_id = _image_token_id(processing_class)
    placeholders = {"image": image_token_id} if image_token_id is not None else None
    try:
        trajectory = from_gym_result(result, on_noncontiguous="split", placeholder_token_ids=placeholders)
    except TrajectoryError as exc:
        if "placeholder" in str(exc):
            raise UntrainableRolloutError(str(exc), reason="placeholder_mismatch", row=row) from exc
        raise
    flat = flatten(trajectory, row=row)
    for medium, turn in zip(flat.media, flat.media_turns, strict=True):
        if medium.modality != "image":
            raise UntrainableRolloutError(
                f"model call {turn} saw a {medium.modality} medium; TRL's rollout_func path carries "
                "images only",
                reason="unsupported_media",
                row=row,
            )
        if turn > 0:
            raise UntrainableRolloutError(
                f"an image arrived after the first model call (it is in model call {turn}'s prompt); TRL's "
                "forward takes its pixels from the dataset prompt only, so it would fail with image "
                "features and tokens that do not match. Train this environment with "
                "gym_environment (TRL's own tool loop carries tool images) or gymbridge's trainer",
                reason="mid_episode_media",
                row=row,
            )
    if rendered is not None and flat.prompt_ids != rendered:
        at = next(
            (k for k, (a, b) in enumerate(zip(flat.prompt_ids, rendered, strict=False)) if a != b),
            min(len(flat.prompt_ids), len(rendered)),
        )
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        raise UntrainableRolloutError(
            f"the agent's first prompt ({len(flat.prompt_ids)} tokens) is not TRL's render of the dataset "
            f"prompt ({len(rendered)} tokens); they part at token {at}: agent "
            f"{tokenizer.decode(flat.prompt_ids[at : at + 12])!r} vs TRL "
            f"{tokenizer.decode(rendered[at : at + 12])!r}. "
            "TRL takes the pixels and their positions from its own render, so it would misalign them "
            "(an agent's system prompt or tools, another chat template)",
            reason="prompt_mismatch",
            row=row,
        )
    return flat
