"""Where media sit in the JSON: one answer for raw dicts and parsed models.

The trajectory walk reads raw dicts (``media_refs_of_*``); other code reads parsed part
models (``part.source``). These tests pin that both agree, and that text never becomes media.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gymbridge import protocol as p
from gymbridge.errors import ProtocolError

PNG = "data:image/png;base64,iVBORw0KGgo="
AGREEING_PARTS: list[dict[str, Any]] = [
    {"type": "input_image", "image_url": PNG, "detail": "auto"},
    {"type": "input_image", "image_url": "file:///data/a.png", "detail": "low"},
    {"type": "input_video", "video_url": "file:///v.mp4"},
    {"type": "input_video", "video": {"url": "https://host/v.mp4", "fps": 2}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    {"type": "input_audio", "input_audio": {"data": "data:audio/flac;base64,ZkxhQw==", "format": "flac"}},
    {"type": "input_audio", "audio_url": "file:///a.wav"},
]


@pytest.mark.parametrize("part", AGREEING_PARTS, ids=lambda part: str(part["type"]))
def test_raw_dict_and_model_name_the_same_reference(part: dict[str, Any]) -> None:
    (model,) = p.parse_content_parts(json.dumps([part]))
    ref = p.media_ref_of_part(part)
    assert ref is not None
    source, modality = ref
    assert isinstance(model, p.InputImagePart | p.InputAudioPart | p.InputVideoPart)
    assert (source, modality) == (model.source, model.modality)


def test_inline_audio_becomes_a_data_url_with_its_format() -> None:
    part = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    assert p.media_ref_of_part(part) == ("data:audio/wav;base64,UklGRg==", "audio")


def test_chat_completions_spellings_are_media_too() -> None:
    content = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": PNG}},
        {"type": "video_url", "video_url": "file:///v.mp4"},
    ]
    assert list(p.media_refs_of_content(content)) == [(PNG, "image"), ("file:///v.mp4", "video")]


@pytest.mark.parametrize(
    "output",
    [
        '{"x": 3}',
        "/tmp/screenshot.png",
        "file:///tmp/screenshot.png",
        "https://example.com/a.png",
        "data:text/plain;base64,aGk=",
        "data:image/png;base64",  # no comma: not a data URL at all
        "",
    ],
)
def test_text_tool_outputs_are_never_media(output: str) -> None:
    assert list(p.media_refs_of_tool_output(output)) == []


def test_data_url_tool_output_and_part_list_are_media() -> None:
    assert list(p.media_refs_of_tool_output(PNG)) == [(PNG, "image")]
    wav = "data:audio/wav;base64,UklGRg=="
    assert list(
        p.media_refs_of_tool_output(
            [{"type": "input_text", "text": "t"}, {"type": "input_audio", "audio_url": wav}]
        )
    ) == [(wav, "audio")]


@pytest.mark.parametrize(
    ("part", "reason"),
    [
        ({"type": "input_image", "detail": "auto"}, "input_image part has none of image_url, image"),
        ({"type": "input_image", "file_id": "file-1"}, "file_id 'file-1'"),
        ({"type": "input_image", "image_url": "  "}, "input_image.image_url is empty"),
        ({"type": "input_video", "video": {"fps": 2}}, "without a 'url' string"),
        ({"type": "input_audio", "input_audio": {"data": 5, "format": "wav"}}, "no base64 'data' string"),
    ],
)
def test_media_part_without_a_reference_is_a_protocol_error_naming_it(
    part: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ProtocolError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        p.media_ref_of_part(part)
