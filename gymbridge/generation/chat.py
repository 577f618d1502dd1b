"""The chat side of generation: conversations in, prompt tokens out; generated tokens in, items out.

Three jobs, one class (:class:`ChatCodec`) per tokenizer / processor:

1. **Normalise** a conversation — Responses API ``input`` items
   (:func:`responses_to_messages`) or Chat Completions ``messages``
   (:func:`chat_to_messages`) — into :class:`ChatMessage` s. Media parts become
   :class:`~gymbridge.media.MediaItem` s through ``load_media`` under the caller's
   ``MediaPolicy`` (refused or broken media raise ``MediaError`` here, before any
   model work). *Which* part or tool output holds media, and of which modality, is
   decided by :mod:`gymbridge.protocol` (``media_ref_of_part``,
   ``media_refs_of_tool_output``) — the same rules the trajectory layer indexes
   media with — so a medium is never rendered into the prompt as base64 text while
   the trajectory counts it as media. The processor expands image, video and audio
   placeholders with their real counts; a modality it has no sub-processor for
   (``video_processor``, ``feature_extractor``) is refused with ``ProtocolError`` when it
   renders. Replayed token
   fields (``prompt_token_ids`` + ``generation_token_ids``) stay on the assistant
   message they came with.
2. **Render** (:meth:`ChatCodec.render`) the conversation with the tokenizer's chat
   template (tools included) into prompt token ids with every media placeholder
   expanded, plus all media in order. *Prefix splice*: when an assistant message
   carries replayed token fields, ``prompt_token_ids + generation_token_ids`` of the
   **latest** such message is kept exactly and only the suffix after it is
   templated — so re-templating history (reasoning dropped, tool-call JSON
   re-serialised, whitespace normalised) never changes earlier tokens.
3. **Parse** generated tokens (:meth:`ChatCodec.parse`) into reasoning
   (``<think>...</think>``), function calls and message text. The tool-call format
   (:mod:`gymbridge.generation.tool_calls`: ``hermes`` ``<tool_call>{json}</tool_call>``,
   ``qwen3_coder`` ``<tool_call><function=...>``) is the codec's ``tool_parser``
   (``auto``: the one the chat template writes). Markup that does not parse (bad JSON,
   no ``name``, an unclosed tag) stays in the message text, visible to the trajectory
   layer as an invalid tool call, and is listed in ``ParsedOutput.unparsed_tool_calls``
   (``tool_call_unparsed``) — never silently dropped.

Splice rule. Let ``k`` be the latest assistant message with token fields and ``P``
its ``prompt_token_ids + generation_token_ids``. ``upto`` is the template of
messages ``[0..k]`` without a generation prompt, ``full`` the template of all
messages with one; ``n`` counts the end-of-turn markers in ``upto`` (which must end
with one). The suffix is ``full`` after its ``n``-th marker; the prompt is ``P``
(closed with the marker token when the generation was cut by ``length``) followed
by the suffix's tokens. Markers are special tokens, so tokenising the suffix alone
gives the tokens it has inside the full text.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gymbridge.errors import ProtocolError
from gymbridge.generation.tool_calls import (
    ToolCall,
    UnparsedToolCall,
    new_call_id,
    resolve_tool_parser,
    tool_call_format,
)
from gymbridge.protocol import media_ref_of_part, media_refs_of_tool_output, metadata_audio_refs

if TYPE_CHECKING:
    from gymbridge.media import MediaItem, MediaPolicy

logger = logging.getLogger(__name__)

__all__ = [
    "ChatCodec",
    "ChatMessage",
    "ParsedOutput",
    "RenderedPrompt",
    "TemplateSpliceError",
    "ToolCall",
    "chat_to_messages",
    "new_call_id",
    "responses_to_messages",
    "responses_tools_to_chat",
]

Role = Literal["system", "developer", "user", "assistant", "tool"]
_ROLES: frozenset[str] = frozenset({"system", "developer", "user", "assistant", "tool"})
_THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


class TemplateSpliceError(ProtocolError):
    """The chat template's output cannot be split at the replayed assistant message."""


@dataclass(slots=True)
class ChatMessage:
    """One conversation message, backend-neutral.

    ``parts`` is an ordered list of text strings and media items. ``prefix_token_ids``
    (assistant messages only) is ``prompt_token_ids + generation_token_ids`` of the
    model call that produced the message, when the caller replayed them.
    """

    role: Role
    parts: list[str | MediaItem] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    prefix_token_ids: list[int] | None = None

    @property
    def text(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))

    @property
    def media(self) -> list[MediaItem]:
        return [p for p in self.parts if not isinstance(p, str)]


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """Prompt tokens (placeholders expanded) and all media of the conversation, in order."""

    prompt_token_ids: list[int]
    media: list[MediaItem]
    spliced: bool
    """True when the latest replayed assistant tokens were kept as the exact prefix."""


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """Generated tokens split into reasoning blocks, message text and tool calls."""

    reasoning: list[str]
    content: str
    tool_calls: list[ToolCall]
    unparsed_tool_calls: list[UnparsedToolCall] = field(default_factory=list)
    """Markup in ``content`` that looks like a tool call but does not parse (``tool_call_unparsed``)."""


# --------------------------------------------------------------------------- normalisation


MediaLoader = Callable[[str, Literal["image", "audio", "video"]], "MediaItem"]
"""``(source, modality) -> MediaItem``: how a conversation's media references become items."""


def _load(source: str, modality: Literal["image", "audio", "video"], policy: MediaPolicy | None) -> MediaItem:
    from gymbridge.media import load_media

    return load_media(source, modality, policy)


def _loader(policy: MediaPolicy | None, loader: MediaLoader | None) -> MediaLoader:
    return loader if loader is not None else lambda source, modality: _load(source, modality, policy)


_TEXT_PART_TYPES: frozenset[str] = frozenset({"text", "input_text", "output_text"})


def _parts_from_content(content: Any, load: MediaLoader, where: str) -> list[str | MediaItem]:
    """Text and media parts of a message ``content`` (a string, ``None`` or a list of parts).

    Text parts are kept as strings; every other part must be a media part by
    :func:`gymbridge.protocol.media_ref_of_part` (else ``ProtocolError``).
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [content] if content else []
    if not isinstance(content, list):
        raise ProtocolError(
            f"{where}: content must be a string or a list of parts, got {type(content).__name__}"
        )
    parts: list[str | MediaItem] = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ProtocolError(f"{where}: content part {i} must be an object")
        kind = part.get("type")
        if kind in _TEXT_PART_TYPES:
            text = part.get("text")
            if not isinstance(text, str):
                raise ProtocolError(f"{where}: content part {i} ({kind}) needs a string 'text'")
            parts.append(text)
            continue
        if kind == "refusal":
            parts.append(str(part.get("refusal", "")))
            continue
        try:
            ref = media_ref_of_part(part)
        except ProtocolError as exc:
            raise ProtocolError(f"{where}: content part {i}: {exc}") from exc
        if ref is None:
            raise ProtocolError(f"{where}: unsupported content part type {kind!r}")
        source, modality = ref
        parts.append(load(source, modality))
    return parts


def _parts_from_tool_output(output: Any, load: MediaLoader, where: str) -> list[str | MediaItem]:
    """A ``function_call_output.output``: a media data URL (image, audio or video), text, or parts."""
    if isinstance(output, str):
        refs = list(media_refs_of_tool_output(output))
        if refs:
            return [load(source, modality) for source, modality in refs]
    return _parts_from_content(output, load, where)


def _token_prefix(obj: Mapping[str, Any], where: str) -> list[int] | None:
    prompt = obj.get("prompt_token_ids")
    gen = obj.get("generation_token_ids")
    if prompt is None and gen is None:
        return None
    if not (isinstance(prompt, list) and isinstance(gen, list)):
        raise ProtocolError(f"{where}: prompt_token_ids and generation_token_ids must both be lists of ints")
    ids = [*prompt, *gen]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ProtocolError(f"{where}: token ids must be integers")
    negative = next((t for t in ids if t < 0), None)
    if negative is not None:
        raise ProtocolError(f"{where}: token id {negative} is negative")
    return ids


def _arguments_str(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def chat_to_messages(
    messages: Any, *, policy: MediaPolicy | None = None, loader: MediaLoader | None = None
) -> list[ChatMessage]:
    """Chat Completions ``messages`` (the shape genuine ``vllm_model`` sends) -> :class:`ChatMessage` s.

    Media load through ``loader`` when given (the model server's cache), else ``load_media``
    under ``policy``.
    """
    load = _loader(policy, loader)
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty list")
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ProtocolError(f"{where} must be an object")
        role = m.get("role")
        if role not in _ROLES:
            raise ProtocolError(f"{where}: unknown role {role!r}")
        msg = ChatMessage(role=role, parts=_parts_from_content(m.get("content"), load, where))
        if role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                msg.reasoning.append(reasoning)
            tool_calls = m.get("tool_calls") or []
            if not isinstance(tool_calls, list):
                raise ProtocolError(f"{where}: tool_calls must be a list")
            for j, tc in enumerate(tool_calls):
                fn = tc.get("function") if isinstance(tc, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise ProtocolError(f"{where}.tool_calls[{j}] needs function.name")
                msg.tool_calls.append(
                    ToolCall(
                        call_id=str(tc.get("id") or new_call_id()),
                        name=fn["name"],
                        arguments=_arguments_str(fn.get("arguments", "{}")),
                    )
                )
            msg.prefix_token_ids = _token_prefix(m, where)
        elif role == "tool":
            msg.tool_call_id = m.get("tool_call_id")
        out.append(msg)
    return out


def responses_to_messages(
    input_items: Any,
    *,
    instructions: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    policy: MediaPolicy | None = None,
    loader: MediaLoader | None = None,
) -> list[ChatMessage]:
    """Responses API ``input`` (a string or a list of items) -> :class:`ChatMessage` s.

    Media load through ``loader`` when given (the model server's cache), else ``load_media``
    under ``policy``.

    Consecutive assistant-side items (``reasoning``, assistant ``message``,
    ``function_call``) merge into one assistant message, as one model call produced
    them; the token fields of the latest such item become its ``prefix_token_ids``.
    The audio of ``metadata`` (stock Gym's side channel: ``audio_data``, ``audio_path`` or
    ``audio_paths``, :func:`gymbridge.protocol.metadata_audio_refs`) is attached to the first
    user message, before its text; a path is read only under the policy's allowed local roots.
    """
    load = _loader(policy, loader)
    items: list[Any]
    if isinstance(input_items, str):
        items = [{"type": "message", "role": "user", "content": input_items}]
    elif isinstance(input_items, list):
        items = input_items
    else:
        raise ProtocolError("'input' must be a string or a list of items")
    if instructions is not None and not isinstance(instructions, str):
        raise ProtocolError("'instructions' must be a string")
    out: list[ChatMessage] = []
    if instructions:
        out.append(ChatMessage(role="system", parts=[instructions]))
    pending: ChatMessage | None = None

    def assistant() -> ChatMessage:
        nonlocal pending
        if pending is None:
            pending = ChatMessage(role="assistant")
            out.append(pending)
        return pending

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise ProtocolError(f"{where} must be an object")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message" and item.get("role") == "assistant":
            a = assistant()
            a.parts.extend(_parts_from_content(item.get("content"), load, where))
        elif kind == "reasoning":
            a = assistant()
            summary = item.get("summary") or []
            if not isinstance(summary, list):
                raise ProtocolError(f"{where}: reasoning summary must be a list")
            texts = [s.get("text", "") for s in summary if isinstance(s, Mapping)]
            a.reasoning.extend(t for t in texts if t)
        elif kind == "function_call":
            a = assistant()
            name = item.get("name")
            if not isinstance(name, str):
                raise ProtocolError(f"{where}: function_call needs a string 'name'")
            a.tool_calls.append(
                ToolCall(
                    call_id=str(item.get("call_id") or new_call_id()),
                    name=name,
                    arguments=_arguments_str(item.get("arguments", "{}")),
                )
            )
        elif kind == "function_call_output":
            pending = None
            parts = _parts_from_tool_output(item.get("output"), load, where)
            out.append(ChatMessage(role="tool", parts=parts, tool_call_id=item.get("call_id")))
            continue
        elif kind == "message":
            role = item.get("role")
            if role not in _ROLES or role == "tool":
                raise ProtocolError(f"{where}: unknown message role {role!r}")
            pending = None
            out.append(ChatMessage(role=role, parts=_parts_from_content(item.get("content"), load, where)))
            continue
        else:
            raise ProtocolError(f"{where}: item type {kind!r} cannot be rendered for a chat model")
        prefix = _token_prefix(item, where)
        if prefix is not None:
            assistant().prefix_token_ids = prefix
    audio_refs = metadata_audio_refs(metadata or {})
    if audio_refs:
        first_user = next((m for m in out if m.role == "user"), None)
        if first_user is None:
            first_user = ChatMessage(role="user")
            out.append(first_user)
        first_user.parts[0:0] = [load(source, "audio") for source, _ in audio_refs]
    return out


def responses_tools_to_chat(tools: Any) -> list[dict[str, Any]]:
    """Responses ``tools`` (flat function specs) -> Chat Completions tools ``{type, function}``."""
    if tools is not None and not isinstance(tools, list):
        raise ProtocolError("'tools' must be a list")
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, Mapping):
            raise ProtocolError(f"tools[{i}] must be an object")
        if "function" in t:
            out.append(dict(t))
            continue
        if t.get("type", "function") != "function" or not isinstance(t.get("name"), str):
            raise ProtocolError(f"tools[{i}]: only function tools with a name are supported")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


# --------------------------------------------------------------------------- codec


class ChatCodec:
    """Chat template rendering with exact prefix splicing, and output parsing, for one processor.

    ``processor`` is a Hugging Face processor (``processor.tokenizer`` is used for
    text, ``processor(text=..., images=...)`` to expand media placeholders) or a bare
    tokenizer for text-only models. ``end_of_turn`` defaults to the processor's family's
    end-of-turn marker (:mod:`gymbridge.families`: ``<|im_end|>``, Gemma 3's ``<end_of_turn>``)
    or, for a processor of no family, the first family marker the vocabulary holds, else the
    tokenizer's eos token.

    Placeholder expansion without the processor: given ``placeholders`` (an item's
    placeholder token count, e.g. from the model server's cache of processor outputs),
    :meth:`encode` replaces each medium's placeholder text with the family's expansion of that
    count (:meth:`~gymbridge.families.ModelFamily.expansion`: Qwen's ``<|image_pad|>`` x N,
    Gemma 3's ``<start_of_image>`` block, InternVL's ``<img>...</img>``) and tokenizes the text
    alone, so a cached medium is never run through the processor again. The first time a modality is
    expanded this way the processor's own answer is computed too and compared: any
    difference (a processor that expands differently) turns the shortcut off for that
    modality for good (logged), so the prompt tokens are always the processor's.
    """

    def __init__(
        self,
        processor: Any,
        *,
        chat_template: str | None = None,
        end_of_turn: str | None = None,
        reasoning_parser: bool = True,
        tool_parser: str | None = "auto",
    ) -> None:
        from gymbridge.families import end_of_turn_markers, family_of

        self.processor = processor
        self.tokenizer: Any = getattr(processor, "tokenizer", processor)
        self.chat_template = chat_template
        self.family = family_of(processor)
        vocab = self.tokenizer.get_vocab()
        if end_of_turn is None:
            markers = (self.family.end_of_turn,) if self.family.end_of_turn else end_of_turn_markers()
            end_of_turn = next((m for m in markers if m in vocab), self.tokenizer.eos_token)
        if not end_of_turn or end_of_turn not in vocab:
            raise ValueError(f"end-of-turn marker {end_of_turn!r} is not a token of this tokenizer")
        self.end_of_turn: str = end_of_turn
        self.end_of_turn_id: int = int(vocab[end_of_turn])
        self.reasoning_parser = reasoning_parser
        template = chat_template
        if template is None:
            template = getattr(processor, "chat_template", None) or getattr(
                self.tokenizer, "chat_template", None
            )
        self.tool_parser: str | None = (
            None if tool_parser is None else resolve_tool_parser(tool_parser, template)
        )
        """The tool-call format parsed (``hermes``, ``qwen3_coder``; ``auto`` resolved from the chat
        template), or ``None``: tool calls stay in the text."""
        self._expansion_ok: dict[str, bool] = {}
        """Modality -> whether expanding its placeholders by count gave the processor's tokens."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a generation: the end-of-turn marker and the eos token."""
        ids = {self.end_of_turn_id}
        eos = self.tokenizer.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        return tuple(sorted(ids))

    # ---- rendering

    def _template_messages(self, messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in messages:
            role = "system" if m.role == "developer" else m.role
            if m.role == "assistant":
                text = "".join(f"<think>{r}</think>" for r in m.reasoning) + m.text
                d: dict[str, Any] = {"role": role, "content": text}
                if m.tool_calls:
                    d["tool_calls"] = [
                        {
                            "id": tc.call_id,
                            "type": "function",
                            "function": {"name": tc.name, "arguments": _json_or_str(tc.arguments)},
                        }
                        for tc in m.tool_calls
                    ]
            else:
                content: list[dict[str, Any]] = []
                for p in m.parts:
                    if isinstance(p, str):
                        content.append({"type": "text", "text": p})
                    else:
                        content.append({"type": p.modality})
                d = {
                    "role": role,
                    "content": content if any(not isinstance(p, str) for p in m.parts) else m.text,
                }
                if m.tool_call_id is not None:
                    d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out

    def template_text(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template's text for ``messages`` (media as unexpanded placeholders)."""
        kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        text = self.tokenizer.apply_chat_template(
            self._template_messages(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
        if not isinstance(text, str):  # pragma: no cover - transformers contract
            raise TypeError("apply_chat_template(tokenize=False) did not return a string")
        return text

    def encode(
        self,
        text: str,
        media: Sequence[MediaItem] = (),
        *,
        decode: Callable[[MediaItem], Any] | None = None,
        placeholders: Callable[[MediaItem], int | None] | None = None,
    ) -> list[int]:
        """Token ids of ``text`` with each media placeholder expanded for ``media`` (in order).

        Images, videos and audio clips go to the processor as ``images=`` / ``videos=`` /
        ``audio=``; a modality the processor has no sub-processor for is refused with
        ``ProtocolError``. ``decode`` (default ``MediaItem.image``) lets a caller reuse images
        it already decoded; ``placeholders`` expands by count instead (class docstring).
        """
        if not media:
            return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        if self.processor is self.tokenizer:
            raise ProtocolError(
                "this model has no processor for media: it cannot take images, video or audio"
            )
        refused = [m for m in media if not self.takes(m.modality)]
        if refused:
            kinds = sorted({m.modality for m in refused})
            raise ProtocolError(
                f"this model's processor cannot expand {'/'.join(kinds)} media; the conversation holds "
                f"{len(refused)} such item(s) (first: {refused[0].short_source!r}): serve a model whose "
                "processor takes them (the tiny omni model takes image, video and audio)"
            )
        if placeholders is not None:
            expanded = self._expanded(text, media, placeholders, decode)
            if expanded is not None:
                return expanded
        return self._processor_encode(text, media, decode)

    def _placeholder_tokens(self) -> dict[str, str]:
        """The template's placeholder text of each modality the family can expand by count."""
        tokens: dict[str, str] = {}
        for modality in ("image", "video", "audio"):
            text = self.family.placeholder_text(self.processor, modality)
            if text is not None:
                tokens[text] = modality
        return tokens

    def _expanded(
        self,
        text: str,
        media: Sequence[MediaItem],
        placeholders: Callable[[MediaItem], int | None],
        decode: Callable[[MediaItem], Any] | None,
    ) -> list[int] | None:
        """:meth:`encode` by placeholder counts, or ``None`` to let the processor do it."""
        modalities = {m.modality for m in media}
        tokens = self._placeholder_tokens()
        if not modalities <= set(tokens.values()) or any(
            self._expansion_ok.get(mod) is False for mod in modalities
        ):
            return None
        queues: dict[str, list[int]] = {mod: [] for mod in tokens.values()}
        for m in media:
            count = placeholders(m)
            if count is None:
                return None
            queues[m.modality].append(count)
        pattern = re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))
        pieces: list[str] = []
        pos = 0
        for match in pattern.finditer(text):
            modality = tokens[match.group(0)]
            queue = queues[modality]
            if not queue:
                return None  # more placeholders than media: the processor says what is wrong
            expanded = self.family.expansion(self.processor, modality, queue.pop(0))
            if expanded is None:
                return None  # a count only the processor can write out (Gemma 3's crops)
            pieces += [text[pos : match.start()], expanded]
            pos = match.end()
        if any(queues.values()):
            return None  # media without placeholders: likewise
        pieces.append(text[pos:])
        ids = [int(t) for t in self.tokenizer("".join(pieces), add_special_tokens=False)["input_ids"]]
        unchecked = [mod for mod in modalities if mod not in self._expansion_ok]
        if unchecked:
            reference = self._processor_encode(text, media, decode)
            for mod in unchecked:
                self._expansion_ok[mod] = reference == ids
            if reference != ids:
                logger.warning(
                    "expanding %s placeholders by count does not give %s's tokens: the processor "
                    "expands them from now on",
                    "/".join(sorted(unchecked)),
                    type(self.processor).__name__,
                )
                return reference
        return ids

    def _processor_encode(
        self, text: str, media: Sequence[MediaItem], decode: Callable[[MediaItem], Any] | None
    ) -> list[int]:
        by_modality: dict[str, list[Any]] = {}
        for m in media:
            value = (decode or _decode_image)(m) if m.modality == "image" else _decode_other(m)
            by_modality.setdefault(m.modality, []).append(value)
        kwargs = {_PROCESSOR_ARG[k]: v for k, v in by_modality.items()}
        try:
            enc = self.processor(text=[text], add_special_tokens=False, return_tensors="pt", **kwargs)
        except ValueError as exc:
            raise ProtocolError(f"media placeholders do not match the media: {exc}") from exc
        return [int(t) for t in enc["input_ids"][0].tolist()]

    def takes(self, modality: str) -> bool:
        """Whether this codec's processor can expand ``modality`` placeholders."""
        if self.processor is self.tokenizer:
            return False
        if modality == "image":
            return True
        attr = {"video": "video_processor", "audio": "feature_extractor"}.get(modality)
        return attr is not None and getattr(self.processor, attr, None) is not None

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        decode: Callable[[MediaItem], Any] | None = None,
        placeholders: Callable[[MediaItem], int | None] | None = None,
    ) -> RenderedPrompt:
        """Prompt tokens for the next model call over ``messages`` (see the module docstring).

        ``decode`` and ``placeholders`` are passed to :meth:`encode`.
        """
        media = [p for m in messages for p in m.media]
        k = next(
            (i for i in range(len(messages) - 1, -1, -1) if messages[i].prefix_token_ids is not None), None
        )
        full = self.template_text(
            messages, tools, add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs
        )
        if k is None:
            return RenderedPrompt(
                self.encode(full, media, decode=decode, placeholders=placeholders), media, spliced=False
            )
        prefix = list(messages[k].prefix_token_ids or [])
        upto = self.template_text(
            messages[: k + 1], tools, add_generation_prompt=False, chat_template_kwargs=chat_template_kwargs
        )
        marker = self.end_of_turn
        if not upto.rstrip().endswith(marker):
            raise TemplateSpliceError(
                f"the chat template does not end an assistant message with {marker!r}: cannot splice "
                "the replayed tokens"
            )
        n = upto.count(marker)
        cut = -1
        for _ in range(n):
            cut = full.find(marker, cut + 1)
            if cut < 0:
                raise TemplateSpliceError(
                    f"the full conversation renders fewer {marker!r} markers than its history ({n})"
                )
        suffix = full[cut + len(marker) :]
        if not prefix or prefix[-1] != self.end_of_turn_id:
            prefix.append(self.end_of_turn_id)
        suffix_media = [p for m in messages[k + 1 :] for p in m.media]
        suffix_ids = self.encode(suffix, suffix_media, decode=decode, placeholders=placeholders)
        return RenderedPrompt(prefix + suffix_ids, media, spliced=True)

    # ---- parsing

    def decode(self, token_ids: Sequence[int]) -> str:
        ids = list(token_ids)
        stops = set(self.stop_token_ids)
        while ids and ids[-1] in stops:
            ids.pop()
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def parse(
        self, token_ids: Sequence[int], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> ParsedOutput:
        """Split generated tokens into reasoning, message text and tool calls.

        ``tools`` (the request's) type the parameters of a ``qwen3_coder`` call by their schema."""
        return self.parse_text(self.decode(token_ids), tools)

    def parse_text(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedOutput:
        reasoning: list[str] = []
        if self.reasoning_parser:
            reasoning = _THINK_BLOCK.findall(text)
            text = _THINK_BLOCK.sub("", text)
            if "</think>" in text and "<think>" not in text.split("</think>", 1)[0]:
                # The template opened the think block in the generation prompt (Qwen3 style).
                head, text = text.split("</think>", 1)
                reasoning.insert(0, head)
        if self.tool_parser is None:
            return ParsedOutput(reasoning=reasoning, content=text, tool_calls=[])
        found = tool_call_format(self.tool_parser).parse(text, tools)
        return ParsedOutput(
            reasoning=reasoning,
            content=found.content,
            tool_calls=found.calls,
            unparsed_tool_calls=found.unparsed,
        )


def _decode_image(item: MediaItem) -> Any:
    return item.image()


def _decode_other(item: MediaItem) -> Any:
    return item.video() if item.modality == "video" else item.audio()


_PROCESSOR_ARG = {"image": "images", "video": "videos", "audio": "audio"}
"""The keyword a Hugging Face processor takes each modality's media under."""


def _json_or_str(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
