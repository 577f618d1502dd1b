"""Direction: gymbridge's simple agent -> genuine NeMo Gym 0.7.0 resources servers.

Our ``SimpleAgent`` drives genuine ``example_session_state_mgmt`` (session state behind the
genuine cookie, which our agent must forward by hand) and genuine ``circle_click`` to the expected
rewards, with the scripted model as the policy. It also checks what our agent sends to the model:
``responses_create_params`` exactly as the row gave it plus ``input`` (genuine servers forbid extra
keys with HTTP 422), and replayed items keep their token fields. With ``rollout_prefix=True`` the
genuine server receives (seen by a recording pass-through proxy) ``/ng-rollout/<id>/...`` paths and
still answers them correctly.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from _genuine import GenuineStack
from _gym_support import ScriptBook, ThreadedLoop, counter_script, scripted
from _oracles import circle_click as circle_click_oracle
from aiohttp import web

import gymbridge.server as server_sdk

pytestmark = pytest.mark.gym


GENUINE_ROWS = Path(__file__).parent / "recorded" / "rows"


@pytest.fixture(scope="module")
def our_agents(
    genuine_stack: GenuineStack, scripted_model_url: str, fixture_loop: ThreadedLoop
) -> Iterator[dict[str, str]]:
    """Our SimpleAgent in front of each genuine resources server of the session stack."""
    running = {}
    for name in ("counter", "circle_click"):
        agent = server_sdk.SimpleAgent(
            resources_url=genuine_stack.url(name),
            model_url=scripted_model_url,
            max_steps=8,
            instance_name=f"our_agent_{name}",
        )
        running[name] = fixture_loop.run(server_sdk.start_server(agent))
    yield {name: rs.url for name, rs in running.items()}
    for rs in running.values():
        fixture_loop.run(rs.stop())


def counter_row(initial: int, increments: list[int]) -> dict[str, Any]:
    tools = json.loads((GENUINE_ROWS / "counter_tools.json").read_text())
    prompt = " then ".join(f"add {k}" for k in increments) + " then get the count"
    return {
        "responses_create_params": {"input": [{"role": "user", "content": prompt}], "tools": tools},
        "initial_count": initial,
        "expected_count": initial + sum(increments),
    }


def post_run(url: str, row: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/run", json=row, timeout=60, trust_env=False)


def test_our_agent_drives_genuine_counter(
    our_agents: dict[str, str], script_book: ScriptBook, scripted_model: Any
) -> None:
    cases = [(3, [1, 2]), (0, [5]), (7, [2, 2, 2]), (1, [9, 1])]
    rows = []
    for i, (initial, incs) in enumerate(cases):
        row = counter_row(initial, incs)
        rows.append(
            scripted(row, script_book.add(f"ours-counter-{i}", counter_script(incs, row["expected_count"])))
        )
    with cf.ThreadPoolExecutor(len(rows)) as pool:
        results = list(pool.map(lambda r: post_run(our_agents["counter"], r), rows))
    assert [r.status_code for r in results] == [200] * len(rows), [r.text[:300] for r in results]
    for (_, incs), row, r in zip(cases, rows, results, strict=True):
        result = r.json()
        assert result["reward"] == 1.0
        outs = [i["output"] for i in result["response"]["output"] if i["type"] == "function_call_output"]
        # the genuine server's exact bodies, kept verbatim; state survived across calls (cookie)
        assert outs[-1] == f'{{"count":{row["expected_count"]}}}'
        assert all(o == '{"success":true}' for o in outs[:-1])
        carriers = [i for i in result["response"]["output"] if i.get("generation_token_ids")]
        assert len(carriers) == len(incs) + 2  # one per model call: increments, the read, the answer

    # what our agent sent the model: the row's responses_create_params keys + input, nothing more
    sent = [
        b
        for b in scripted_model.requests
        if str((b.get("metadata") or {}).get("script", "")).startswith("ours-counter-")
    ]
    assert sent
    for body in sent:
        assert set(body) <= {"input", "tools", "metadata"}, sorted(body)
    # replayed model items keep their token fields
    last = max(sent, key=lambda b: len(b["input"]))
    replayed_calls = [i for i in last["input"] if i.get("type") == "function_call"]
    assert replayed_calls and all("generation_token_ids" in i for i in replayed_calls)


def test_our_agent_unseeded_mismatch_scores_zero(our_agents: dict[str, str], script_book: ScriptBook) -> None:
    """A wrong final count through our agent scores 0 at the genuine verifier (the reward is earned)."""
    row = counter_row(2, [3])
    name = script_book.add("ours-counter-wrong", counter_script([4], 6))
    r = post_run(our_agents["counter"], scripted(row, name))
    assert r.status_code == 200 and r.json()["reward"] == 0.0


def test_our_agent_drives_genuine_circle_click(our_agents: dict[str, str], script_book: ScriptBook) -> None:
    row = json.loads((GENUINE_ROWS / "circle_click_example_row0.json").read_text())
    name = script_book.add("ours-circle", circle_click_oracle(row))
    r = post_run(our_agents["circle_click"], scripted(row, name))
    assert r.status_code == 200, r.text[:500]
    result = r.json()
    assert result["reward"] == 1.0 and result["hit"] is True
    target = next(c for c in row["circles"] if c["color"] == row["target_color"])
    assert (result["clicked_x"], result["clicked_y"]) == (target["x"], target["y"])


def test_our_agent_extra_key_row_stays_out_of_responses_create_params(
    our_agents: dict[str, str], script_book: ScriptBook, scripted_model: Any
) -> None:
    """Top-level row keys (task data, ids) never leak into what the model or verifier validates."""
    row = counter_row(1, [1])
    row.update({"_ng_task_index": 3, "_ng_rollout_index": 1, "gymbridge_request_id": "r-1"})
    name = script_book.add("ours-counter-extra", counter_script([1], 2))
    r = post_run(our_agents["counter"], scripted(row, name))
    assert r.status_code == 200, r.text[:500]
    assert r.json()["reward"] == 1.0
    sent = [b for b in scripted_model.requests if (b.get("metadata") or {}).get("script") == name]
    assert sent and all(set(b) <= {"input", "tools", "metadata"} for b in sent)


class RecordingProxy:
    """A pass-through HTTP proxy in front of a genuine server that records every path it forwards."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.paths: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        return app

    async def _forward(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("cookie", "content-type")}
        async with (
            aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as client,
            client.request(
                request.method, self.upstream + request.path_qs, data=await request.read(), headers=headers
            ) as upstream,
        ):
            body = await upstream.read()
            reply = web.Response(body=body, status=upstream.status, content_type=upstream.content_type)
            for line in upstream.headers.getall("Set-Cookie", ()):
                reply.headers.add("Set-Cookie", line)
            return reply


def test_our_agent_rollout_prefix_reaches_genuine_counter(
    genuine_stack: GenuineStack,
    scripted_model_url: str,
    scripted_model: Any,
    fixture_loop: ThreadedLoop,
    script_book: ScriptBook,
) -> None:
    """``rollout_prefix=True``: every resources call goes to ``/ng-rollout/<id>/...`` and genuine 0.7.0
    answers them as the bare paths (prefix stripped, cookie session kept), so the reward is still 1."""
    proxy = RecordingProxy(genuine_stack.url("counter"))
    proxy_server = fixture_loop.run(server_sdk.start_server(proxy.app()))
    agent = server_sdk.SimpleAgent(
        resources_url=proxy_server.url,
        model_url=scripted_model_url,
        instance_name="our_agent_prefixed",
        rollout_prefix=True,
    )
    agent_server = fixture_loop.run(server_sdk.start_server(agent))
    cases = {  # rollout id -> (row identity keys, initial count, increments)
        "5-1": ({"_ng_task_index": 5, "_ng_rollout_index": 1}, 2, [3]),
        "ours-prefix-b-a2": ({"_ng_rollout_id": "ours-prefix-b", "_ng_attempt_index": 2}, 4, [1, 1]),
    }
    try:
        for rollout_id, (identity, initial, incs) in cases.items():
            row = {**counter_row(initial, incs), **identity}
            name = script_book.add(f"ours-prefix-{rollout_id}", counter_script(incs, row["expected_count"]))
            proxy.paths.clear()
            r = post_run(agent_server.url, scripted(row, name))
            assert r.status_code == 200, r.text[:500]
            result = r.json()
            assert result["reward"] == 1.0, result
            outs = [i["output"] for i in result["response"]["output"] if i["type"] == "function_call_output"]
            assert outs[-1] == f'{{"count":{row["expected_count"]}}}'  # state kept under the prefix
            prefix = f"/ng-rollout/{rollout_id}"
            expected = [
                f"{prefix}/seed_session",
                *[f"{prefix}/increment_counter"] * len(incs),
                f"{prefix}/get_counter_value",
                f"{prefix}/verify",
            ]
            assert proxy.paths == expected
            model_paths = [
                p
                for p, b in zip(scripted_model.request_paths, scripted_model.requests, strict=True)
                if (b.get("metadata") or {}).get("script") == name
            ]
            assert model_paths and all(p == f"{prefix}/v1/responses" for p in model_paths), model_paths
    finally:
        fixture_loop.run(agent_server.stop())
        fixture_loop.run(proxy_server.stop())
