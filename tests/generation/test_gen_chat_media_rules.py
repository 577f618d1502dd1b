"""The chat renderer and the trajectory layer agree on which parts and tool outputs hold media.

Both ask :mod:`gymbridge.protocol` (``media_ref_of_part``, ``media_refs_of_tool_output``).
Before, ``chat.py`` kept its own copy of the rules and treated a tool output as media
only when it began with ``data:image/``: an audio or video tool output was rendered
into the prompt as base64 text while the trajectory indexed it as media.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from typing import Any

import av
import httpx
import numpy as np
import pytest
import soundfile as sf
from gen_helpers import png_data_url

from gymbridge.errors import ProtocolError
from gymbridge.generation.chat import chat_to_messages, responses_to_messages
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.server import ModelServer, ModelServerConfig
from gymbridge.media import encode_data_url
from gymbridge.protocol import media_refs_of_content, media_refs_of_tool_output
from gymbridge.trajectory import from_gym_result


def wav_data_url(seconds: float = 0.1, rate: int = 8000) -> str:
    buf = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    sf.write(
        buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16"
    )
    return encode_data_url(buf.getvalue(), "audio/wav")


def mp4_data_url(num_frames: int = 3, size: int = 16) -> str:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=5)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), 40 * i, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return encode_data_url(buf.getvalue(), "video/mp4")


WAV = wav_data_url()
MP4 = mp4_data_url()
PNG = png_data_url()


def tool_call_then_output(output: Any) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": [{"type": "input_text", "text": "listen"}]},
        {"type": "function_call", "call_id": "c1", "name": "record", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": output},
    ]


def test_regression_audio_tool_output_is_media_not_text() -> None:
    """A ``data:audio/...`` tool output used to become base64 text in the tool message."""
    tool = responses_to_messages(tool_call_then_output(WAV))[-1]
    assert tool.role == "tool" and tool.tool_call_id == "c1"
    assert tool.text == ""  # no base64 in the prompt text
    assert [m.modality for m in tool.media] == ["audio"]
    waveform, rate = tool.media[0].audio()
    assert rate == 8000 and waveform.shape[0] == 800


def test_regression_video_tool_output_is_media_not_text() -> None:
    tool = responses_to_messages(tool_call_then_output(MP4))[-1]
    assert tool.text == "" and [m.modality for m in tool.media] == ["video"]
    assert tool.media[0].video().shape[1:] == (16, 16, 3)


@pytest.mark.parametrize(
    "output",
    [
        PNG,
        WAV,
        MP4,
        WAV.replace("data:audio/wav", "DATA:Audio/WAV", 1),
        '{"x": 3}',
        "done",
        "",
        "/tmp/screenshot.png",
        "https://example.com/a.png",
        "data:text/plain,hello",
        [{"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": PNG}],
        [{"type": "input_audio", "input_audio": {"data": WAV.split(",", 1)[1], "format": "wav"}}],
        [{"type": "input_video", "video_url": MP4}, {"type": "output_text", "text": "clip"}],
    ],
    ids=lambda o: o[:24] if isinstance(o, str) else "parts",
)
def test_chat_and_trajectory_find_the_same_media_in_a_tool_output(output: Any) -> None:
    expected = [modality for _, modality in media_refs_of_tool_output(output)]
    tool = responses_to_messages(tool_call_then_output(output))[-1]
    assert [m.modality for m in tool.media] == expected
    if expected and isinstance(output, str):
        assert tool.text == ""
    elif isinstance(output, str):
        assert tool.text == output  # text stays text, verbatim

    # and the trajectory built from the same items indexes exactly those media
    gen = {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}
    items = tool_call_then_output(output)
    result = {
        "responses_create_params": {"input": items[:1]},
        "response": {
            "output": [
                {**items[1], **gen},
                items[2],
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "ok"}],
                    "prompt_token_ids": [1, 2, 3, 4, 5],
                    "generation_token_ids": [6],
                    "generation_log_probs": [-0.5],
                },
            ]
        },
        "reward": 1.0,
    }
    traj = from_gym_result(result)
    assert [m.modality for turn in traj.turns for m in turn.media] == expected


def test_chat_content_parts_follow_the_protocol_rules() -> None:
    content = [
        {"type": "input_image", "image": PNG},  # the alternative key the protocol accepts
        {"type": "input_audio", "audio_url": WAV},
        {"type": "text", "text": "what do you see and hear?"},
    ]
    (msg,) = chat_to_messages([{"role": "user", "content": content}])
    assert [m.modality for m in msg.media] == [m for _, m in media_refs_of_content(content)]
    assert [m.modality for m in msg.media] == ["image", "audio"]
    assert msg.text == "what do you see and hear?"


@pytest.mark.parametrize(
    ("part", "needle"),
    [
        ({"type": "input_image"}, "none of image_url"),
        ({"type": "input_image", "file_id": "file-1"}, "file_id"),
        ({"type": "input_image", "image_url": "  "}, "empty"),
        ({"type": "input_file", "file_id": "f"}, "unsupported content part type 'input_file'"),
    ],
)
def test_media_part_without_a_usable_reference_is_a_protocol_error_naming_the_part(
    part: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ProtocolError, match=needle) as info:
        chat_to_messages([{"role": "user", "content": [part]}])
    assert "messages[0]" in str(info.value)


def test_images_only_codec_refuses_audio_instead_of_rendering_base64(tiny_gen: HFGenerator) -> None:
    messages = responses_to_messages(tool_call_then_output(WAV))
    payload = WAV.split(",", 1)[1]
    assert payload[:40] not in tiny_gen.codec.template_text(messages)  # a placeholder, not the bytes
    with pytest.raises(ProtocolError, match=r"cannot expand audio media.*1 such item.*data:audio/wav;base64"):
        tiny_gen.codec.render(messages)


@pytest.fixture
async def client(tiny_gen: HFGenerator) -> AsyncIterator[httpx.AsyncClient]:
    config = ModelServerConfig(model_name="tiny", max_model_len=600, default_max_tokens=4)
    srv = ModelServer(tiny_gen, config=config)
    await srv.start()
    try:
        async with httpx.AsyncClient(base_url=str(srv.url), timeout=60) as c:
            yield c
    finally:
        await srv.stop()


@pytest.mark.integration
@pytest.mark.parametrize(("output", "modality"), [(WAV, "audio"), (MP4, "video")])
async def test_model_server_answers_400_for_non_image_tool_output(
    client: httpx.AsyncClient, output: str, modality: str
) -> None:
    reply = await client.post("/v1/responses", json={"model": "tiny", "input": tool_call_then_output(output)})
    assert reply.status_code == 400
    body = reply.json()
    assert modality in body["message"] and "cannot expand" in body["message"]
    assert output.split(",", 1)[1][:40] not in body["message"]  # the payload is not echoed back
