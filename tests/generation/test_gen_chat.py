"""ChatCodec: parsing generated text into items, normalising conversations, the exact prefix splice."""

from __future__ import annotations

import json
from typing import Any

import pytest
from gen_helpers import png_data_url
from hypothesis import given, settings
from hypothesis import strategies as st

from gymbridge.errors import MediaPolicyError, ProtocolError
from gymbridge.generation.chat import ChatCodec, chat_to_messages, responses_to_messages
from gymbridge.generation.hf import HFGenerator

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "zoom",
            "description": "Zoom into a region.",
            "parameters": {"type": "object", "properties": {"bbox": {"type": "array"}}},
        },
    }
]


def ids_of(codec: ChatCodec, text: str) -> list[int]:
    return [int(t) for t in codec.tokenizer(text, add_special_tokens=False)["input_ids"]]


# ---------------------------------------------------------------- parsing


def test_parse_splits_reasoning_tool_call_and_text(tiny_gen: HFGenerator) -> None:
    codec = tiny_gen.codec
    text = (
        "<think>look left</think>I will zoom."
        '<tool_call>\n{"name": "zoom", "arguments": {"bbox": [1, 2]}}\n</tool_call>'
    )
    parsed = codec.parse([*ids_of(codec, text), codec.end_of_turn_id])
    assert parsed.reasoning == ["look left"]
    assert parsed.content == "I will zoom."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("zoom", {"bbox": [1, 2]})]
    assert parsed.tool_calls[0].call_id.startswith("call_")


def test_malformed_tool_call_stays_in_the_text(tiny_gen: HFGenerator) -> None:
    codec = tiny_gen.codec
    for body in ('{"name": "zoom", "arguments": {', '{"arguments": {}}', "[1, 2]"):
        text = f"<tool_call>{body}</tool_call>"
        parsed = codec.parse_text(text)
        assert parsed.tool_calls == []
        assert parsed.content == text  # visible to the trajectory layer as an invalid call


def test_qwen3_style_open_think_in_prompt(tiny_gen: HFGenerator) -> None:
    parsed = tiny_gen.codec.parse_text("plan the zoom</think>The answer is 42.")
    assert parsed.reasoning == ["plan the zoom"]
    assert parsed.content == "The answer is 42."


def test_reasoning_parser_off_keeps_think_tags(tiny: Any) -> None:
    codec = ChatCodec(tiny.processor, reasoning_parser=False)
    parsed = codec.parse_text("<think>x</think>y")
    assert parsed.reasoning == [] and parsed.content == "<think>x</think>y"


@settings(max_examples=25, deadline=None)
@given(
    args=st.dictionaries(
        st.text("abcxyz_", min_size=1, max_size=6),
        st.one_of(
            st.integers(-1000, 1000), st.text("abc 123", max_size=8), st.lists(st.integers(0, 9), max_size=4)
        ),
        max_size=4,
    )
)
def test_rendered_tool_call_parses_back(tiny_gen: HFGenerator, args: dict[str, Any]) -> None:
    """Property: what the template renders for an assistant tool call parses back to the same call."""
    codec = tiny_gen.codec
    msgs = chat_to_messages(
        [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "zoom", "arguments": json.dumps(args)},
                    }
                ],
            },
        ]
    )
    text = codec.template_text(msgs, TOOLS, add_generation_prompt=False)
    generated = text[text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n") :]
    parsed = codec.parse_text(generated.removesuffix("\n").removesuffix("<|im_end|>"))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("zoom", args)]


# ---------------------------------------------------------------- normalisation


def test_responses_items_merge_into_one_assistant_message_with_the_latest_tokens() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "zoom",
            "arguments": "{}",
            "prompt_token_ids": [1, 2],
            "generation_token_ids": [3],
            "generation_log_probs": [-0.1],
        },
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
    ]
    msgs = responses_to_messages(items, instructions="be brief")
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[2].reasoning == ["r"] and msgs[2].tool_calls[0].name == "zoom"
    assert msgs[2].prefix_token_ids == [1, 2, 3]
    assert msgs[3].tool_call_id == "c1" and msgs[3].text == "done"


def test_images_become_media_items_in_order() -> None:
    red, blue = png_data_url((255, 0, 0)), png_data_url((0, 0, 255))
    msgs = responses_to_messages(
        [
            {"role": "user", "content": [{"type": "input_image", "image_url": red, "detail": "auto"}]},
            {"type": "function_call", "call_id": "c", "name": "zoom", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c",
                "output": [{"type": "input_image", "image_url": blue}],
            },
        ]
    )
    media = [p for m in msgs for p in m.media]
    assert [m.image().getpixel((0, 0)) for m in media] == [(255, 0, 0), (0, 0, 255)]


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "non-empty"),
        ([{"role": "wizard", "content": "x"}], "unknown role"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input_file"),
        ([{"role": "assistant", "content": "x", "prompt_token_ids": [1]}], "both be lists"),
    ],
)
def test_bad_conversations_raise_protocol_errors(messages: Any, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        chat_to_messages(messages)


def test_media_outside_the_policy_is_refused(tmp_path: Any) -> None:
    secret = tmp_path / "x.png"
    secret.write_bytes(b"\x89PNG")
    with pytest.raises(MediaPolicyError):
        chat_to_messages(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{secret}"}}]}]
        )


# ---------------------------------------------------------------- rendering and the splice


def test_first_call_renders_the_template_with_expanded_placeholders(tiny_gen: HFGenerator, tiny: Any) -> None:
    msgs = chat_to_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": png_data_url()}},
                    {"type": "text", "text": "hi"},
                ],
            }
        ]
    )
    rendered = tiny_gen.codec.render(msgs, TOOLS)
    assert not rendered.spliced and len(rendered.media) == 1
    text = tiny_gen.codec.template_text(msgs, TOOLS)
    expected = tiny.processor(text=[text], images=[rendered.media[0].image()], add_special_tokens=False)
    assert rendered.prompt_token_ids == expected["input_ids"][0].tolist()
    assert rendered.prompt_token_ids.count(tiny.image_token_id) > 1  # expanded, not one placeholder


def test_prefix_splice_keeps_the_exact_earlier_tokens(tiny_gen: HFGenerator) -> None:
    """Regression (prefix splice): history that re-templates differently keeps its exact token ids.

    The replayed assistant turn was generated with tokens the template would never
    produce (odd whitespace inside the tool-call JSON, a reasoning block that the
    replay carries only as ``reasoning_content``). Re-templating would change them;
    the next prompt must start with the generated tokens verbatim.
    """
    codec = tiny_gen.codec
    first = chat_to_messages([{"role": "user", "content": "zoom please"}])
    prompt0 = codec.render(first, TOOLS).prompt_token_ids
    generated_text = (
        '<think> hmm </think><tool_call>{"name":"zoom",   "arguments":{"bbox":[1,2,3,4]}}</tool_call>'
    )
    gen0 = [*ids_of(codec, generated_text), codec.end_of_turn_id]
    parsed = codec.parse(gen0)
    replay = [
        {"role": "user", "content": "zoom please"},
        {
            "role": "assistant",
            "content": parsed.content or None,
            "reasoning_content": "".join(parsed.reasoning),
            "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.tool_calls
            ],
            "prompt_token_ids": prompt0,
            "generation_token_ids": gen0,
            "generation_log_probs": [0.0] * len(gen0),
        },
        {"role": "tool", "tool_call_id": parsed.tool_calls[0].call_id, "content": "zoomed"},
    ]
    msgs = chat_to_messages(replay)
    rendered = codec.render(msgs, TOOLS)
    assert rendered.spliced
    assert rendered.prompt_token_ids[: len(prompt0) + len(gen0)] == prompt0 + gen0
    # the control: plain re-templating would NOT have kept them
    for m in msgs:
        m.prefix_token_ids = None
    retemplated = codec.render(msgs, TOOLS).prompt_token_ids
    assert retemplated[: len(prompt0) + len(gen0)] != prompt0 + gen0
    # the suffix is what the template renders after the assistant turn
    suffix = codec.decode(rendered.prompt_token_ids[len(prompt0) + len(gen0) :])
    assert (
        suffix
        == "\n<|im_start|>user\n<tool_response>\nzoomed\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_splice_closes_a_generation_cut_by_length(tiny_gen: HFGenerator) -> None:
    codec = tiny_gen.codec
    prompt0 = codec.render(chat_to_messages([{"role": "user", "content": "count"}])).prompt_token_ids
    gen0 = ids_of(codec, "one two thr")  # no end-of-turn: finish_reason == "length"
    msgs = chat_to_messages(
        [
            {"role": "user", "content": "count"},
            {
                "role": "assistant",
                "content": "one two thr",
                "prompt_token_ids": prompt0,
                "generation_token_ids": gen0,
            },
            {"role": "user", "content": "go on"},
        ]
    )
    out = codec.render(msgs).prompt_token_ids
    n = len(prompt0) + len(gen0)
    assert out[:n] == prompt0 + gen0 and out[n] == codec.end_of_turn_id


def test_the_latest_replayed_item_wins(tiny_gen: HFGenerator) -> None:
    codec = tiny_gen.codec
    p0 = codec.render(chat_to_messages([{"role": "user", "content": "a"}])).prompt_token_ids
    g0 = [*ids_of(codec, "b"), codec.end_of_turn_id]
    conv: list[dict[str, Any]] = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "prompt_token_ids": p0, "generation_token_ids": g0},
        {"role": "user", "content": "c"},
    ]
    p1 = codec.render(chat_to_messages(conv)).prompt_token_ids
    g1 = [*ids_of(codec, "d"), codec.end_of_turn_id]
    conv += [
        {"role": "assistant", "content": "d", "prompt_token_ids": p1, "generation_token_ids": g1},
        {"role": "user", "content": "e"},
    ]
    p2 = codec.render(chat_to_messages(conv)).prompt_token_ids
    assert p2[: len(p1) + len(g1)] == p1 + g1 and p1[: len(p0) + len(g0)] == p0 + g0
