"""Direction: gymbridge's client -> genuine simple_agent -> genuine resources servers.

``GymClient.run_many`` collects rollouts from genuine ``simple_agent`` in front of genuine
``example_session_state_mgmt`` and genuine ``circle_click`` (the policy is gymbridge's scripted
model), and ``from_gym_result`` turns every result into the expected turns: token fields survive
the genuine agent untouched, circle_click's image sits on turn 0, the counter's reward is 1 (its
session cookie survived seed -> tools -> verify inside the genuine agent). Also the 0.7.0 result
shape: top-level ``mask_sample`` / ``failure_kind`` / ``failure_reason`` reach ``Trajectory``, and
the client never adds keys inside ``responses_create_params`` (genuine agents answer 422).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from _genuine import GenuineStack
from _gym_support import ScriptBook, counter_script, scripted
from _oracles import circle_click as circle_click_oracle

import gymbridge.client as client_mod
import gymbridge.trajectory as trajectory_mod

pytestmark = pytest.mark.gym


GENUINE_ROWS = Path(__file__).parent / "recorded" / "rows"


def counter_row(initial: int, increments: list[int], task_index: int) -> dict[str, Any]:
    tools = json.loads((GENUINE_ROWS / "counter_tools.json").read_text())
    prompt = " then ".join(f"add {k}" for k in increments) + " then get the count"
    return {
        "responses_create_params": {"input": [{"role": "user", "content": prompt}], "tools": tools},
        "initial_count": initial,
        "expected_count": initial + sum(increments),
        "_ng_task_index": task_index,
        "_ng_rollout_index": 0,
    }


async def collect(url: str, rows: list[dict[str, Any]], concurrency: int = 8) -> list[Any]:
    async with client_mod.GymClient(agent_url=url, deadline_s=60, max_attempts=2) as client:
        outcomes = [o async for o in client.run_many(rows, concurrency=concurrency, progress=False)]
    return sorted(outcomes, key=lambda o: o.index)


async def test_run_many_genuine_counter_parses_into_turns(
    genuine_stack: GenuineStack, script_book: ScriptBook
) -> None:
    cases = [(3, [1, 2]), (0, [4]), (5, [1, 1, 1]), (2, [7, 3]), (9, [1]), (4, [2, 6])]
    rows = []
    for i, (initial, incs) in enumerate(cases):
        row = counter_row(initial, incs, task_index=i)
        rows.append(
            scripted(row, script_book.add(f"client-counter-{i}", counter_script(incs, row["expected_count"])))
        )
    outcomes = await collect(genuine_stack.url("counter_agent"), rows)

    assert [o.index for o in outcomes] == list(range(len(rows)))
    assert all(o.ok for o in outcomes), [(o.kind, o.reason) for o in outcomes if not o.ok]
    for (_, incs), outcome in zip(cases, outcomes, strict=True):
        result = outcome.result
        traj = trajectory_mod.from_gym_result(result)
        assert traj.reward == 1.0  # the session cookie survived seed -> tools -> verify
        assert [t.kind for t in traj.turns] == ["function_call"] * (len(incs) + 1) + ["message"]
        assert [t.tool_name for t in traj.turns[:-1]] == ["increment_counter"] * len(incs) + [
            "get_counter_value"
        ]
        # token fields survive the genuine agent untouched, one turn per model call
        carriers = [i for i in result["response"]["output"] if i.get("generation_token_ids")]
        assert [t.generation_token_ids for t in traj.turns] == [c["generation_token_ids"] for c in carriers]
        assert [t.generation_logprobs for t in traj.turns] == [c["generation_log_probs"] for c in carriers]
        last = carriers[-1]
        assert traj.token_ids(0) == last["prompt_token_ids"] + last["generation_token_ids"]
        assert sum(traj.loss_mask(0)) == sum(len(c["generation_token_ids"]) for c in carriers)
        assert all(t.media == [] for t in traj.turns)
        assert (traj.mask_sample, traj.failure_class, traj.failure_reason, traj.truncated) == (
            False,
            None,
            None,
            False,
        )
        # genuine counter's verify drops undeclared row keys, _ng_task_index included: the
        # outcome keeps the row, so the task index is never lost on the client side
        assert "_ng_task_index" not in result and outcome.row["_ng_task_index"] == outcome.index


async def test_run_many_genuine_circle_click_image_on_turn_0(
    genuine_stack: GenuineStack, script_book: ScriptBook
) -> None:
    row = json.loads((GENUINE_ROWS / "circle_click_example_row0.json").read_text())
    name = script_book.add("client-circle", circle_click_oracle(row))
    miss = script_book.add(
        "client-circle-miss", [{"calls": [{"name": "click", "arguments": {"x": 1, "y": 1}}]}]
    )
    outcomes = await collect(
        genuine_stack.url("circle_click_agent"), [scripted(row, name), scripted(row, miss)]
    )
    assert all(o.ok for o in outcomes), [(o.kind, o.reason) for o in outcomes]
    hit, missed = (trajectory_mod.from_gym_result(o.result) for o in outcomes)
    assert (hit.reward, missed.reward) == (1.0, 0.0)
    assert [t.kind for t in hit.turns] == ["function_call"]
    (image,) = hit.turns[0].media
    assert image.modality == "image"
    url = row["responses_create_params"]["input"][1]["content"][0]["image_url"]
    raw = base64.b64decode(url.split(",", 1)[1])
    assert image.key == hashlib.sha256(raw).hexdigest()
    assert image.image().size == (1000, 1000)


async def test_client_never_adds_keys_to_responses_create_params(
    genuine_stack: GenuineStack, script_book: ScriptBook, scripted_model: Any
) -> None:
    """The genuine agent validates responses_create_params with extra keys forbidden (422)."""
    row = scripted(counter_row(1, [1], task_index=0), script_book.add("client-keys", counter_script([1], 2)))
    sent_rcp = copy.deepcopy(row["responses_create_params"])
    (ok,) = await collect(genuine_stack.url("counter_agent"), [row])
    assert ok.ok, ok.reason
    assert row["responses_create_params"] == sent_rcp  # the row given is the row sent
    first_call = next(
        b for b in scripted_model.requests if (b.get("metadata") or {}).get("script") == "client-keys"
    )
    assert set(first_call) <= set(sent_rcp) | {"input"}, sorted(first_call)

    bad = copy.deepcopy(row)
    bad["responses_create_params"]["gymbridge_extra"] = True
    (refused,) = await collect(genuine_stack.url("counter_agent"), [bad])
    # a 422 is data, not infrastructure: recorded, not retried
    assert (refused.ok, refused.kind, refused.status, refused.attempts) == (False, "data", 422, 1)
    assert "extra_forbidden" in (refused.reason or "")


async def test_discovery_through_genuine_head_server(
    genuine_stack: GenuineStack, script_book: ScriptBook
) -> None:
    """GymClient(head_url=...) reads the genuine head's config and routes rows by agent_ref."""
    head = genuine_stack.url("head_server")
    row = counter_row(2, [3], task_index=0)
    counter = scripted(row, script_book.add("client-head-counter", counter_script([3], 5)))
    counter["agent_ref"] = {"type": "responses_api_agents", "name": "counter_agent"}
    circle_row = json.loads((GENUINE_ROWS / "circle_click_example_row0.json").read_text())
    circle = scripted(circle_row, script_book.add("client-head-circle", circle_click_oracle(circle_row)))
    circle["agent_ref"] = {"type": "responses_api_agents", "name": "circle_click_agent"}
    unknown = {
        **copy.deepcopy(counter),
        "agent_ref": {"type": "responses_api_agents", "name": "no_such_agent"},
    }

    async with client_mod.GymClient(head_url=head, deadline_s=60, max_attempts=1) as client:
        agents = await client.discover()
        outcomes = sorted(
            [o async for o in client.run_many([counter, circle, unknown], concurrency=3, progress=False)],
            key=lambda o: o.index,
        )
    assert agents == {
        "counter_agent": genuine_stack.url("counter_agent"),
        "circle_click_agent": genuine_stack.url("circle_click_agent"),
    }
    ok_counter, ok_circle, refused = outcomes
    assert (
        ok_counter.ok
        and ok_counter.agent_url == genuine_stack.url("counter_agent")
        and ok_counter.reward == 1.0
    )
    assert (
        ok_circle.ok
        and ok_circle.agent_url == genuine_stack.url("circle_click_agent")
        and ok_circle.reward == 1.0
    )
    assert (refused.ok, refused.kind, refused.attempts) == (False, "data", 0)
    assert "no_such_agent" in (refused.reason or "")
