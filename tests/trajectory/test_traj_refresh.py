"""The refresh rule: every model call sees the whole current conversation, media included."""

from __future__ import annotations

import io
import math
import struct
import wave

import numpy as np
import pytest
from traj_helpers import assistant, call, call_output, image_part, png_bytes, png_url, result, tok, user_msg

from gymbridge.media import MediaItem
from gymbridge.trajectory import ConversationHistory, GenerationInput, build_generation_input, from_gym_result

RED, GREEN = png_url((200, 0, 0), 6), png_url((0, 200, 0), 10)


def _four_turns() -> dict[str, object]:
    out = [
        assistant("look", **tok([1, 2], [3])),  # turn 0 owns RED (initial input)
        user_msg("go on"),
        call("act", "c1", **tok([1, 2, 3, 4], [5])),  # turn 1
        call_output('{"ok": true}', "c1"),
        call("shot", "c2", **tok([1, 2, 3, 4, 5, 6], [7])),  # turn 2
        call_output(GREEN, "c2"),  # the tool image at turn 2 -> turn 3
        assistant("done", **tok([1, 2, 3, 4, 5, 6, 7, 8], [9, 10])),  # turn 3
    ]
    return result(out, input_items=[user_msg([image_part(RED), {"type": "input_text", "text": "hi"}])])


def test_turn3_input_after_a_tool_image_carries_both_images_and_all_tokens() -> None:
    res = _four_turns()
    traj = from_gym_result(res)
    turn0 = build_generation_input(ConversationHistory.from_trajectory(traj, 0))
    turn3 = build_generation_input(ConversationHistory.from_trajectory(traj, 3))
    assert isinstance(turn3, GenerationInput)
    # the full current token sequence, exactly what the model server reported as turn 3's prompt
    assert turn3.prompt_token_ids == res["response"]["output"][6]["prompt_token_ids"]  # type: ignore[index]
    images = turn3.multi_modal_data["image"]
    assert [im.size for im in images] == [(6, 6), (10, 10)]
    assert [im.getpixel((3, 3)) for im in images] == [(200, 0, 0), (0, 200, 0)]
    assert set(turn3.multi_modal_data) == {"image"}
    # and it is not the turn-0 input
    assert turn0.prompt_token_ids == [1, 2]
    assert [im.size for im in turn0.multi_modal_data["image"]] == [(6, 6)]
    assert turn3 != turn0


def test_every_turn_input_equals_the_reported_prompt() -> None:
    res = _four_turns()
    traj = from_gym_result(res)
    for turn in traj.turns:
        gen_input = build_generation_input(ConversationHistory.from_trajectory(traj, turn.index))
        item = res["response"]["output"][turn.item_index]  # type: ignore[index]
        assert gen_input.prompt_token_ids == item["prompt_token_ids"]
    counts = [
        len(build_generation_input(ConversationHistory.from_trajectory(traj, k)).media) for k in range(4)
    ]
    assert counts == [1, 1, 1, 2]


def test_text_only_history_has_no_multi_modal_data() -> None:
    traj = from_gym_result(result([assistant("a", **tok([1], [2])), assistant("b", **tok([1, 2, 3], [4]))]))
    gen_input = build_generation_input(ConversationHistory.from_trajectory(traj, 1))
    assert gen_input.multi_modal_data == {}
    assert gen_input.media == []
    assert gen_input.prompt_token_ids == [1, 2, 3]


def _wav(rate: int = 8000, n: int = 400) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", int(1000 * math.sin(i))) for i in range(n)))
    return buf.getvalue()


def test_native_history_appends_and_groups_media_by_modality_in_order() -> None:
    red = MediaItem.from_bytes(png_bytes((200, 0, 0)), "image")
    audio = MediaItem.from_bytes(_wav(), "audio")
    green = MediaItem.from_bytes(png_bytes((0, 200, 0)), "image")
    history = ConversationHistory()
    history.append([1, 2, 3], [red, audio])
    before = build_generation_input(history)
    history.append([4, 5])  # the generation
    history.append([6, 7], [green])  # the observation
    after = build_generation_input(history)

    assert before.prompt_token_ids == [1, 2, 3]  # an input handed out never changes afterwards
    assert len(before.multi_modal_data["image"]) == 1
    assert after.prompt_token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert [im.getpixel((1, 1)) for im in after.multi_modal_data["image"]] == [(200, 0, 0), (0, 200, 0)]
    ((wave_arr, rate),) = after.multi_modal_data["audio"]
    assert rate == 8000 and wave_arr.dtype == np.float32 and wave_arr.shape[0] == 400
    assert after.media == [red, audio, green]


def test_each_media_item_is_decoded_once_per_history(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original = MediaItem.image

    def counting_image(self: MediaItem) -> object:
        calls.append(self.key)
        return original(self)

    monkeypatch.setattr(MediaItem, "image", counting_image)
    history = ConversationHistory()
    history.append([1], [MediaItem.from_bytes(png_bytes((1, 2, 3)), "image")])
    for step in range(5):
        history.append(
            [10 + step], [MediaItem.from_bytes(png_bytes((step, 0, 0)), "image")] if step == 2 else []
        )
        build_generation_input(history)
    assert len(calls) == 2


def test_history_edited_in_place_is_redecoded() -> None:
    history = ConversationHistory()
    history.append([1], [MediaItem.from_bytes(png_bytes((200, 0, 0)), "image")])
    build_generation_input(history)
    history.media[0] = MediaItem.from_bytes(png_bytes((0, 0, 200)), "image")
    assert build_generation_input(history).multi_modal_data["image"][0].getpixel((1, 1)) == (0, 0, 200)


def test_from_trajectory_out_of_range() -> None:
    traj = from_gym_result(result([assistant("a", **tok([1], [2]))]))
    with pytest.raises(IndexError):
        ConversationHistory.from_trajectory(traj, 1)


def test_split_segment_history_starts_from_its_full_prompt() -> None:
    out = [
        assistant("a", **tok([1, 2], [3])),
        call_output(GREEN),
        assistant("b", **tok([1, 9, 4], [5])),  # does not extend [1, 2, 3]
        assistant("c", **tok([1, 9, 4, 5, 6], [7])),
    ]
    traj = from_gym_result(result(out, input_items=[user_msg([image_part(RED)])]), on_noncontiguous="split")
    gen_input = build_generation_input(ConversationHistory.from_trajectory(traj, 2))
    assert gen_input.prompt_token_ids == [1, 9, 4, 5, 6]
    assert [m.source for m in gen_input.media] == [RED, GREEN]
