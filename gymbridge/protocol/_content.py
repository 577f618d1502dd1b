"""Content parts: the pieces of a message's ``content`` list (and of tool outputs).

Modelled parts: ``input_text``, ``input_image`` (``image_url`` + ``detail``),
``input_audio`` (gymbridge extension: ``input_audio: {data, format}`` as in Chat
Completions, or an ``audio_url``), ``input_video`` (``video_url`` or ``video``, a
URL string or ``{"url": ...}``; exactly one), ``output_text`` (``annotations``
always written), ``refusal``, ``summary_text`` and ``reasoning_text``.

Any other part ``type`` becomes an :class:`UnknownPart` and is written back
verbatim. A part whose ``type`` is one of the modelled ones but whose body does not
fit is an error, never silently demoted to "unknown".

Media sources (``image_url`` …) are kept as plain ``str``: parsing a multi-megabyte
base64 data URL costs one string copy, never per-character work. ``part.source``
gives the reference string to hand to :func:`gymbridge.media.load_media`, by the
same rules as the raw-dict helpers of :mod:`gymbridge.protocol._media_refs`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from gymbridge.protocol._base import WireModel
from gymbridge.protocol._media_refs import VIDEO_KEYS, Modality, inline_audio_url

__all__ = [
    "KNOWN_PART_TYPES",
    "ContentPart",
    "InputAudio",
    "InputAudioPart",
    "InputImagePart",
    "InputTextPart",
    "InputVideoPart",
    "MediaPart",
    "OutputTextPart",
    "ReasoningTextPart",
    "RefusalPart",
    "SummaryTextPart",
    "UnknownPart",
    "VideoSource",
]

KNOWN_PART_TYPES: frozenset[str] = frozenset(
    {
        "input_text",
        "input_image",
        "input_audio",
        "input_video",
        "output_text",
        "refusal",
        "summary_text",
        "reasoning_text",
    }
)


def reject_known_type(known: frozenset[str], what: str) -> AfterValidator:
    """Validator for the ``type`` of a passthrough model: modelled types must not land there."""

    def check(value: str) -> str:
        if value in known:
            raise PydanticCustomError(
                "gymbridge_known_type",
                "{what} type {value!r} is modelled, so its body must match that model",
                {"what": what, "value": value},
            )
        return value

    return AfterValidator(check)


class InputTextPart(WireModel):
    """``{"type": "input_text", "text": ...}``."""

    type: Literal["input_text"] = "input_text"
    text: str
    _emit_fields = ("type",)


class InputImagePart(WireModel):
    """``{"type": "input_image", "image_url": "data:…" | "file://…" | "https://…", "detail": "auto"}``.

    ``detail`` is always written for parts built in Python (Gym's image part requires it).
    """

    modality: ClassVar[Modality] = "image"

    type: Literal["input_image"] = "input_image"
    image_url: str | None = None
    detail: str | None = "auto"
    file_id: str | None = None
    _emit_fields = ("type", "detail")

    @property
    def source(self) -> str | None:
        """The media reference (``image_url``), or ``None`` for a ``file_id``-only part."""
        return self.image_url


class InputAudio(WireModel):
    """Inline audio: base64 ``data`` (or a full data URL) and its container ``format``."""

    data: str
    format: str


class InputAudioPart(WireModel):
    """``{"type": "input_audio", "input_audio": {"data", "format"}}`` or ``{..., "audio_url": ...}``.

    Stock Gym carries audio in ``metadata.audio_data``; gymbridge also accepts this part.
    Exactly one of ``input_audio`` / ``audio_url`` is required.
    """

    modality: ClassVar[Modality] = "audio"

    type: Literal["input_audio"] = "input_audio"
    input_audio: InputAudio | None = None
    audio_url: str | None = None
    _emit_fields = ("type",)

    @model_validator(mode="after")
    def _one_source(self) -> InputAudioPart:
        if (self.input_audio is None) == (self.audio_url is None):
            raise ValueError("input_audio requires exactly one of input_audio or audio_url")
        return self

    @property
    def source(self) -> str:
        """A reference string: the ``audio_url``, or a data URL built from the inline data."""
        if self.audio_url is not None:
            return self.audio_url
        assert self.input_audio is not None
        return inline_audio_url(self.input_audio.data, self.input_audio.format)


class VideoSource(WireModel):
    """The object form of a video reference: ``{"url": ...}`` (extra keys such as fps kept)."""

    url: str


class InputVideoPart(WireModel):
    """``{"type": "input_video", "video_url": "file:///…"}`` (or ``video``; a string or ``{"url"}``)."""

    modality: ClassVar[Modality] = "video"

    type: Literal["input_video"] = "input_video"
    video_url: str | VideoSource | None = None
    video: str | VideoSource | None = None
    _emit_fields = ("type",)

    @model_validator(mode="after")
    def _one_source(self) -> InputVideoPart:
        given = [name for name in VIDEO_KEYS if name in self.model_fields_set]
        if len(given) != 1:
            raise ValueError("input_video requires exactly one of video_url or video")
        if not self.source.strip():
            raise ValueError(f"input_video.{given[0]} must contain a non-empty URL")
        return self

    @property
    def source(self) -> str:
        """The video URL, whichever key and form carried it."""
        ref = self.video_url if self.video_url is not None else self.video
        if isinstance(ref, VideoSource):
            return ref.url
        return ref or ""


class OutputTextPart(WireModel):
    """``{"type": "output_text", "text": ..., "annotations": [...]}`` (assistant messages)."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None
    _emit_fields = ("type", "annotations")


class RefusalPart(WireModel):
    """``{"type": "refusal", "refusal": ...}``."""

    type: Literal["refusal"] = "refusal"
    refusal: str
    _emit_fields = ("type",)


class SummaryTextPart(WireModel):
    """``{"type": "summary_text", "text": ...}`` (reasoning summaries)."""

    type: Literal["summary_text"] = "summary_text"
    text: str
    _emit_fields = ("type",)


class ReasoningTextPart(WireModel):
    """``{"type": "reasoning_text", "text": ...}`` (raw reasoning content)."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str
    _emit_fields = ("type",)


class UnknownPart(WireModel):
    """Any other content part; every key is kept and written back unchanged."""

    type: Annotated[str, reject_known_type(KNOWN_PART_TYPES, "content part")]


KnownPart = Annotated[
    InputTextPart
    | InputImagePart
    | InputAudioPart
    | InputVideoPart
    | OutputTextPart
    | RefusalPart
    | SummaryTextPart
    | ReasoningTextPart,
    Field(discriminator="type"),
]

#: One content part: a modelled part (dispatched on ``type`` in Rust) or an :class:`UnknownPart`.
ContentPart = Annotated[KnownPart | UnknownPart, Field(union_mode="left_to_right")]

#: The parts that carry media.
MediaPart = InputImagePart | InputAudioPart | InputVideoPart
