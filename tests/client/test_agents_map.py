"""``GymClient(agents={name: url})``: rows routed by ``agent_ref`` over a map of agents, no head server.

The routing a run with ``env.mix`` uses (one agent per environment); ``env_of_row`` is the one
reading of a row's ``agent_ref`` that the client, the bridge and the run share.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.client import GymClient, agent_ref, env_of_row

ROW: dict[str, Any] = {"responses_create_params": {"input": "hi"}, "_ng_task_index": 0}
AGENTS = {"color_pick": "http://127.0.0.1:40001/", "side_pick": "http://127.0.0.1:40002"}


def _recording() -> tuple[list[str], httpx.MockTransport]:
    hits: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/run"  # no discovery call: the map is the whole routing table
        hits.append(f"{request.url.host}:{request.url.port}")
        return httpx.Response(
            200, json={**json.loads(request.content), "response": {"output": []}, "reward": 1.0}
        )

    return hits, httpx.MockTransport(handler)


async def test_rows_go_to_the_agent_their_agent_ref_names() -> None:
    hits, transport = _recording()
    async with GymClient(agents=AGENTS, transport=transport) as client:
        assert await client.discover() == {
            "color_pick": "http://127.0.0.1:40001",
            "side_pick": AGENTS["side_pick"],
        }
        side = await client.run({**ROW, "agent_ref": agent_ref("side_pick")})
        color = await client.run({**ROW, "agent_ref": {"name": "color_pick"}})  # type is optional
    assert side.ok and color.ok
    assert hits == ["127.0.0.1:40002", "127.0.0.1:40001"]
    assert (side.agent_url, color.agent_url) == ("http://127.0.0.1:40002", "http://127.0.0.1:40001")


async def test_an_unknown_or_missing_agent_ref_is_a_data_failure_without_a_call() -> None:
    hits, transport = _recording()
    async with GymClient(agents=AGENTS, transport=transport) as client:
        unknown = await client.run({**ROW, "agent_ref": agent_ref("zoom_read")})
        missing = await client.run(ROW)
    assert hits == []
    assert unknown.kind == "data" and unknown.attempts == 0
    assert "'zoom_read'" in (unknown.reason or "") and "color_pick" in (unknown.reason or "")
    assert missing.kind == "data" and "no agent_ref" in (missing.reason or "")


async def test_one_agent_takes_the_rows_that_name_none() -> None:
    hits, transport = _recording()
    async with GymClient(agents={"only": "http://127.0.0.1:40009"}, transport=transport) as client:
        assert (await client.run(ROW)).ok
    assert hits == ["127.0.0.1:40009"]


def test_exactly_one_of_agent_url_head_url_or_agents() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        GymClient("http://a", agents=AGENTS)
    with pytest.raises(ValueError, match="exactly one"):
        GymClient(head_url="http://h", agents=AGENTS)
    with pytest.raises(ValueError, match="at least one agent"):
        GymClient(agents={})


@given(
    st.one_of(
        st.none(),
        st.integers(),
        st.text(),
        st.dictionaries(st.sampled_from(["name", "type"]), st.one_of(st.none(), st.integers(), st.text())),
    )
)
def test_env_of_row_is_the_agent_ref_name_or_none(ref: Any) -> None:
    row = {**ROW, "agent_ref": ref}
    name = ref.get("name") if isinstance(ref, dict) else None
    assert env_of_row(row) == (name if isinstance(name, str) and name else None)
    assert env_of_row(ROW) is None
    assert env_of_row({"agent_ref": agent_ref("x")}) == "x"
    assert agent_ref("x") == {"type": "responses_api_agents", "name": "x"}
