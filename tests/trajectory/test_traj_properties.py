"""Property tests: from_gym_result against a plain reference model of the walk."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from traj_helpers import (
    assistant,
    call,
    call_output,
    image_part,
    png_url,
    reasoning_item,
    result,
    tok,
    user_msg,
)

from gymbridge.errors import TrajectoryError
from gymbridge.trajectory import from_gym_result

IMAGES = [png_url((40 * i, 0, 0)) for i in range(5)]
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# a context event: ("user", images) | ("tool_str", image or text) | ("tool_list", images) | ("other",)
context_event = st.one_of(
    st.tuples(st.just("user"), st.lists(st.sampled_from(IMAGES), max_size=2)),
    st.tuples(
        st.just("tool_str"), st.one_of(st.sampled_from(IMAGES), st.sampled_from(["/a.png", '{"x": 3}', "ok"]))
    ),
    st.tuples(st.just("tool_list"), st.lists(st.sampled_from(IMAGES), max_size=2)),
    st.tuples(st.just("other"), st.none()),
)
# a model call: (kind, generation length (0 = empty generation), preceded by an untokened reasoning item)
model_call = st.tuples(
    st.sampled_from(["message", "reasoning", "function_call"]), st.integers(0, 4), st.booleans()
)
step = st.one_of(st.tuples(st.just("ctx"), context_event), st.tuples(st.just("call"), model_call))


def _build(
    initial: list[str], steps: list[Any], diverge_at: set[int]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The Gym result, and the reference turns (kind, item index, media, segment, delta, generation)."""
    output: list[dict[str, Any]] = []
    expected: list[dict[str, Any]] = []
    all_media = list(initial)
    pending = list(initial)
    seen: list[int] = []
    next_tok = 10
    segment = 0
    calls = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_tok
        out = list(range(next_tok, next_tok + n))
        next_tok += n
        return out

    obs = fresh(2)
    for kind, payload in steps:
        if kind == "ctx":
            what, value = payload
            if what == "user":
                output.append(
                    user_msg([*(image_part(u) for u in value), {"type": "input_text", "text": "t"}])
                )
                pending += value
                all_media += value
            elif what == "tool_str":
                output.append(call_output(value))
                if value.startswith("data:"):
                    pending.append(value)
                    all_media.append(value)
            elif what == "tool_list":
                output.append(call_output([image_part(u) for u in value]))
                pending += value
                all_media += value
            else:
                output.append({"type": "mcp_list_tools", "id": "x", "server_label": "s", "tools": []})
            obs += fresh(1)
            continue
        turn_kind, n_gen, pre_reasoning = payload
        if pre_reasoning:
            output.append(reasoning_item("pre"))
        diverges = calls in diverge_at and bool(seen)
        calls += 1
        prompt = (fresh(1) + seen[1:] if diverges else seen) + obs
        gen = fresh(n_gen)
        tokens = tok(prompt, gen)
        if turn_kind == "message":
            item = assistant("x", **tokens)
        elif turn_kind == "reasoning":
            item = reasoning_item("r", **tokens)
        else:
            item = call("f", **tokens)
        output.append(item)
        if not gen:
            # an empty generation is not a turn: nothing recorded, history unchanged for the reference
            obs = prompt[len(seen) :] if not diverges else obs
            continue
        new_segment = diverges or not expected
        if diverges:
            segment += 1
        expected.append(
            {
                "kind": turn_kind,
                "item_index": len(output) - 1,
                "media": list(all_media) if new_segment else pending,
                "segment": segment,
                "delta": prompt if new_segment else prompt[len(seen) :],
                "generation": gen,
            }
        )
        pending = []
        seen = prompt + gen
        obs = fresh(1)
    return result(output, input_items=[user_msg([image_part(u) for u in initial])]), expected


@SETTINGS
@given(st.lists(st.sampled_from(IMAGES), max_size=2), st.lists(step, max_size=14))
def test_walk_matches_reference_model(initial: list[str], steps: list[Any]) -> None:
    res, expected = _build(initial, steps, set())
    if not expected:
        with pytest.raises(TrajectoryError, match="no trainable item"):
            from_gym_result(res)
        return
    traj = from_gym_result(res)
    got = [
        {
            "kind": t.kind,
            "item_index": t.item_index,
            "media": [m.source for m in t.media],
            "segment": t.segment,
            "delta": t.prompt_token_ids,
            "generation": t.generation_token_ids,
        }
        for t in traj.turns
    ]
    assert got == expected
    assert [t.index for t in traj.turns] == list(range(len(traj.turns)))
    # every media item that arrived before the last turn is owned by exactly one turn
    assert traj.num_segments == 1
    last_item = res["response"]["output"][traj.turns[-1].item_index]
    assert traj.token_ids(0) == last_item["prompt_token_ids"] + last_item["generation_token_ids"]
    assert sum(traj.loss_mask(0)) == sum(len(t["generation"]) for t in expected)


@SETTINGS
@given(
    st.lists(st.sampled_from(IMAGES), max_size=2),
    st.lists(step, max_size=14),
    st.sets(st.integers(0, 8), max_size=3),
)
def test_split_keeps_every_generated_token_and_error_names_the_first_divergence(
    initial: list[str], steps: list[Any], diverge_at: set[int]
) -> None:
    res, expected = _build(initial, steps, diverge_at)
    if not expected:
        return
    output = res["response"]["output"]
    first_split = next((e for e in expected if e["segment"] > 0), None)
    if first_split is not None:
        segment_start = next(e for e in expected if e["segment"] == first_split["segment"])
        with pytest.raises(TrajectoryError, match="non-contiguous") as info:
            from_gym_result(res)
        assert info.value.item_index == segment_start["item_index"]
    traj = from_gym_result(res, on_noncontiguous="split")
    assert [t.segment for t in traj.turns] == [e["segment"] for e in expected]
    assert [[m.source for m in t.media] for t in traj.turns] == [e["media"] for e in expected]
    total = 0
    for s in range(traj.num_segments):
        last = traj.segment_turns(s)[-1]
        item = output[last.item_index]
        assert traj.token_ids(s) == item["prompt_token_ids"] + item["generation_token_ids"]
        total += sum(traj.loss_mask(s))
    assert total == sum(len(e["generation"]) for e in expected)
