"""The verl adapter's parts that need no verl (result -> ``AgentLoopOutput`` fields), and the missing extras.

``GymAgentLoop`` itself runs inside ``.venv-verl`` (``test_verl_agent_loop.py``); here the main venv
checks the conversion it uses on results built from the tiny tokenizer's own tokens.
"""

from __future__ import annotations

import sys
from typing import Any

import orjson
import pytest

from gymbridge.errors import UntrainableRolloutError
from gymbridge.integrations.verl import _runs, agent_loop_fields, check_processor, verl_rows
from gymbridge.models.tiny_vlm import IMAGE_PAD, build_tiny_tokenizer
from gymbridge_envs.color_pick.data import COLORS, make_row

TOK = build_tiny_tokenizer()
PAD = int(TOK.convert_tokens_to_ids(IMAGE_PAD))
IMAGE = make_row(0, 0, reveal="prompt")["responses_create_params"]["input"][0]["content"][0]


def _ids(text: str) -> list[int]:
    return [int(t) for t in TOK(text, add_special_tokens=False)["input_ids"]]


def _image_turn(n: int = 4) -> list[int]:
    return _ids("<|vision_start|>") + [PAD] * n + _ids("<|vision_end|>")


def _two_image_result() -> tuple[dict[str, Any], list[int], list[int]]:
    """A look, look, answer rollout: two tool images after the first model call."""
    call = _ids('<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call><|im_end|>')
    answer = _ids("red<|im_end|>")
    p0 = _ids("<|im_start|>user\nlook<|im_end|>\n<|im_start|>assistant\n")
    tool = _ids("\n<|im_start|>user\n") + _image_turn() + _ids("<|im_end|>\n<|im_start|>assistant\n")
    p1, p2 = p0 + call + tool, p0 + call + tool + call + tool

    def fc(prompt: list[int], cid: str) -> dict[str, Any]:
        tokens = {
            "prompt_token_ids": prompt,
            "generation_token_ids": call,
            "generation_log_probs": [-0.1] * len(call),
        }
        return {"type": "function_call", "call_id": cid, "name": "look", "arguments": "{}", **tokens}

    output = [
        fc(p0, "c1"),
        {"type": "function_call_output", "call_id": "c1", "output": "The image:"},
        {"type": "message", "role": "user", "content": [IMAGE]},
        fc(p1, "c2"),
        {"type": "function_call_output", "call_id": "c2", "output": "The image:"},
        {"type": "message", "role": "user", "content": [IMAGE]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "red", "annotations": []}],
         "prompt_token_ids": p2, "generation_token_ids": answer,
         "generation_log_probs": [-0.2] * len(answer)},
    ]  # fmt: skip
    result = {"responses_create_params": {"input": "look"}, "response": {"output": output}, "reward": 1.0}
    return result, p0, p2 + answer


def test_fields_carry_every_image_in_order_the_mask_and_the_reward() -> None:
    result, p0, whole = _two_image_result()
    fields = agent_loop_fields(
        result, placeholder_token_ids={"image": PAD}, prompt_length=64, response_length=256
    )
    assert fields["prompt_ids"] == p0 and fields["prompt_ids"] + fields["response_ids"] == whole
    images = fields["multi_modal_data"]["images"]
    assert len(images) == 2 and images[0].getpixel((1, 1)) == COLORS["red"]
    generated = [t for t, m in zip(fields["response_ids"], fields["response_mask"], strict=True) if m]
    call = _ids('<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call><|im_end|>')
    assert generated == call * 2 + _ids("red<|im_end|>")  # both look calls and the answer, nothing else
    assert fields["response_ids"].count(PAD) == 8  # both images' placeholders, in the response
    assert fields["reward_score"] == 1.0 and fields["num_turns"] == 6  # prompt, 3 calls, 2 tool answers
    assert [
        lp for lp, m in zip(fields["response_logprobs"], fields["response_mask"], strict=True) if not m
    ] == [0.0] * (len(fields["response_mask"]) - sum(fields["response_mask"]))


def test_a_masked_result_keeps_its_tokens_but_trains_nothing() -> None:
    result, _, whole = _two_image_result()
    masked = {**result, "reward": 0.0, "mask_sample": True, "failure_kind": "transport_unreachable",
              "failure_reason": "environment fault: tool 'look' answered HTTP 502: Bad Gateway"}  # fmt: skip
    fields = agent_loop_fields(
        masked, placeholder_token_ids={"image": PAD}, prompt_length=64, response_length=256
    )
    assert fields["prompt_ids"] + fields["response_ids"] == whole
    assert set(fields["response_mask"]) == {0} and fields["reward_score"] == 0.0
    assert fields["extra_fields"]["gym_failure"].startswith("transport_unreachable: environment fault")


def test_a_long_response_is_cut_before_a_placeholder_run_and_its_image_dropped() -> None:
    result, p0, whole = _two_image_result()
    response = whole[len(p0) :]
    second = _runs(response, PAD)[1]
    cut_inside = second[0] + 2  # response_length falls inside the second image's run
    fields = agent_loop_fields(
        result, placeholder_token_ids={"image": PAD}, prompt_length=64, response_length=cut_inside
    )
    assert fields["response_ids"] == response[: second[0]]
    assert len(fields["multi_modal_data"]["images"]) == 1  # the second image went with its tokens
    assert len(fields["response_mask"]) == len(fields["response_logprobs"]) == second[0]


def test_a_prompt_over_prompt_length_is_refused_not_cut() -> None:
    result, p0, _ = _two_image_result()
    with pytest.raises(UntrainableRolloutError) as info:
        agent_loop_fields(
            result, placeholder_token_ids={"image": PAD}, prompt_length=len(p0) - 1, response_length=256
        )
    assert info.value.reason == "prompt_too_long"


def test_media_that_disagree_with_their_placeholders_are_refused() -> None:
    result, _, _ = _two_image_result()
    output = result["response"]["output"]
    output[5] = {
        "type": "message",
        "role": "user",
        "content": [IMAGE, IMAGE],
    }  # two images, one placeholder run
    with pytest.raises(UntrainableRolloutError) as info:
        agent_loop_fields(result, placeholder_token_ids={"image": PAD}, prompt_length=64, response_length=256)
    assert info.value.reason == "placeholder_mismatch"


def test_a_history_that_does_not_only_append_is_refused() -> None:
    result, _, _ = _two_image_result()
    # a re-rendered history (compaction): the first tool image kept, the earlier turns rewritten
    rewritten = (
        _ids("<|im_start|>user\nsummary ") + _image_turn() + _ids("<|im_end|>\n<|im_start|>assistant\n")
    )
    result["response"]["output"][3]["prompt_token_ids"] = rewritten
    with pytest.raises(UntrainableRolloutError) as info:
        agent_loop_fields(result, placeholder_token_ids={"image": PAD}, prompt_length=64, response_length=256)
    assert info.value.reason == "noncontiguous"


def test_verl_rows_keep_the_gym_row_and_the_text_prompt() -> None:
    row = make_row(0, 3, colors="red,blue", reveal="prompt")
    (record,) = verl_rows([row])
    assert orjson.loads(record["gym_row"]) == row and record["agent_name"] == "gym_agent"
    assert record["prompt"] == [
        {"role": "user", "content": row["responses_create_params"]["input"][0]["content"][1]["text"]}
    ]


def test_check_processor_refuses_what_verl_would_train_text_only() -> None:
    from gymbridge.errors import IntegrationError
    from gymbridge.models.tiny_vlm import TinyImageProcessor

    class GridProcessor:  # a Qwen-style processor verl did not bind get_rope_index to
        image_processor = TinyImageProcessor.build()

    with pytest.raises(IntegrationError, match="get_rope_index"):
        check_processor(GridProcessor(), "qwen2_vl")
    with pytest.raises(IntegrationError, match="no processor"):
        check_processor(None, "qwen2_5_vl")
    check_processor(None, "qwen2")  # a text model needs none


@pytest.mark.parametrize(
    ("module", "name", "extra"),
    [
        ("gymbridge.integrations.verl", "GymAgentLoop", "verl"),
        ("gymbridge.integrations.trl", "gym_rollout_func", "trl"),
    ],
)
def test_a_missing_trainer_package_names_the_extra(
    module: str, name: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    blocked = "verl.experimental.agent_loop.agent_loop" if extra == "verl" else "trl"
    monkeypatch.setitem(sys.modules, blocked, None)  # import of it raises ImportError
    mod = importlib.import_module(module)
    monkeypatch.delitem(mod.__dict__, "GymAgentLoop", raising=False)

    def use() -> None:
        obj = getattr(mod, name)
        if extra == "trl":
            obj("http://agent.test")

    with pytest.raises(ImportError, match=rf"pip install 'gymbridge\[{extra}\]'"):
        use()
