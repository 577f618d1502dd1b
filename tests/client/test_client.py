"""GymClient with in-process transports: classification, bounded retries, exactly-one-outcome, discovery."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymbridge.client import GymClient, RolloutOutcome, parse_global_config, server_urls
from gymbridge.errors import ProtocolError

ROW = {"responses_create_params": {"input": "hi"}, "_ng_task_index": 0}


def ok_result(row: dict[str, Any], reward: float = 1.0) -> dict[str, Any]:
    return {**row, "response": {"output": []}, "reward": reward}


def client_for(handler: Callable[[httpx.Request], httpx.Response], **kwargs: Any) -> GymClient:
    kwargs.setdefault("backoff_initial_s", 0.001)
    kwargs.setdefault("backoff_max_s", 0.002)
    return GymClient("http://agent", transport=httpx.MockTransport(handler), **kwargs)


class Script:
    """A mock agent answering from a list of (status, body) per call."""

    def __init__(self, *answers: tuple[int, Any]) -> None:
        self.answers = list(answers)
        self.calls = 0
        self.bodies: list[Any] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        status, body = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(body, bytes):
            return httpx.Response(status, content=body)
        return httpx.Response(status, json=body)


@pytest.mark.parametrize(
    ("answers", "kind", "attempts"),
    [
        ([(200, ok_result(ROW))], None, 1),
        ([(500, "boom"), (200, ok_result(ROW))], None, 2),
        ([(503, "x"), (429, "slow down"), (408, "t"), (200, ok_result(ROW))], "infra", 3),
        ([(502, "x")], "infra", 3),
        ([(404, {"detail": "Not Found"})], "data", 1),
        ([(422, {"detail": []})], "data", 1),
        ([(200, b"<html>not json")], "data", 1),
        ([(200, [1, 2])], "data", 1),
        ([(200, {"response": {}, "reward": "high"})], "data", 1),
        ([(200, {"reward": 1.0})], "data", 1),
    ],
)
async def test_classification_and_bounded_retries(
    answers: list[tuple[int, Any]], kind: str | None, attempts: int
) -> None:
    script = Script(*answers)
    async with client_for(script) as client:
        outcome = await client.run(ROW)
    assert outcome.kind == kind, outcome.reason
    assert outcome.attempts == attempts == script.calls
    if kind is None:
        assert outcome.ok and outcome.reward == 1.0
    else:
        assert not outcome.ok and outcome.reason


async def test_row_is_sent_unchanged() -> None:
    script = Script((200, ok_result(ROW)))
    row = {
        "responses_create_params": {"input": "hi", "temperature": 0.5},
        "extra": [1, 2],
        "agent_ref": {"name": "a"},
    }
    async with client_for(script) as client:
        await client.run(row)
    assert script.bodies == [row]


async def test_malformed_row_is_data_without_a_call() -> None:
    script = Script((200, ok_result(ROW)))
    async with client_for(script) as client:
        outcome = await client.run({"responses_create_params": "not an object"})
    assert (outcome.kind, outcome.attempts, script.calls) == ("data", 0, 0)


async def test_regression_rows_without_responses_create_params_are_run_bodies() -> None:
    """aviary-style rows ({"task_idx": N}; the agent builds the prompt) were refused before any call."""
    row = {"task_idx": 3, "agent_ref": {"type": "responses_api_agents", "name": "aviary_agent"}}
    script = Script((200, ok_result(row)))
    async with client_for(script) as client:
        outcome = await client.run(row)
    assert outcome.ok, outcome.reason
    assert script.bodies == [row]


def test_outcome_is_success_xor_failure() -> None:
    with pytest.raises(ValueError, match="either"):
        RolloutOutcome(index=0, row={}, result={"reward": 1.0}, kind="data")
    with pytest.raises(ValueError, match="either"):
        RolloutOutcome(index=0, row={})


async def test_run_many_one_outcome_per_row_and_failures_jsonl(tmp_path: Path) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        row = json.loads(request.content)
        i = row["i"]
        if i % 5 == 0:
            return httpx.Response(400, json={"detail": "bad row"})
        return httpx.Response(200, json=ok_result(row, reward=i / 100))

    rows = [{"responses_create_params": {"input": str(i)}, "i": i} for i in range(50)]
    failures = tmp_path / "out" / "failures.jsonl"
    async with client_for(handler) as client:
        outcomes = [
            o async for o in client.run_many(rows, concurrency=7, progress=False, failures_path=failures)
        ]
    assert sorted(o.index for o in outcomes) == list(range(50))
    assert all(o.row is rows[o.index] for o in outcomes)
    failed = [o for o in outcomes if not o.ok]
    assert {o.index for o in failed} == set(range(0, 50, 5))
    records = [orjson.loads(line) for line in failures.read_bytes().splitlines()]
    assert sorted(r["index"] for r in records) == list(range(0, 50, 5))
    assert all(r["kind"] == "data" and r["row"]["i"] == r["index"] for r in records)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    statuses=st.lists(st.sampled_from([200, 200, 200, 400, 404, 429, 500, 503]), min_size=0, max_size=40),
    concurrency=st.integers(min_value=1, max_value=16),
)
async def test_property_every_row_exactly_once(statuses: list[int], concurrency: int) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        row = json.loads(request.content)
        status = statuses[row["i"]]
        return httpx.Response(status, json=ok_result(row) if status == 200 else "err")

    rows = [{"responses_create_params": {}, "i": i} for i in range(len(statuses))]
    async with client_for(handler, max_attempts=2) as client:
        outcomes = [o async for o in client.run_many(iter(rows), concurrency=concurrency, progress=False)]
    assert sorted(o.index for o in outcomes) == list(range(len(rows)))
    for o in outcomes:
        status = statuses[o.index]
        assert o.ok == (status == 200)
        assert o.kind == (None if status == 200 else ("infra" if status in (429, 500, 503) else "data"))


async def test_breaking_out_cancels_in_flight() -> None:
    rows = [{"responses_create_params": {}, "i": i} for i in range(100)]
    seen = 0
    async with client_for(lambda r: httpx.Response(200, json=ok_result(json.loads(r.content)))) as client:
        gen = client.run_many(rows, concurrency=4, progress=False)
        async for _ in gen:
            seen += 1
            if seen == 3:
                break
        await gen.aclose()
    assert seen == 3


GLOBAL_CONFIG_YAML = """\
head_server:
  host: 127.0.0.1
  port: 11000
counter_simple_agent:
  responses_api_agents:
    simple_agent:
      entrypoint: app.py
      host: 0.0.0.0
      port: 40123
      max_steps: 8
      resources_server:
        type: resources_servers
        name: counter
counter:
  resources_servers:
    counter:
      entrypoint: app.py
      host: 127.0.0.1
      port: 40124
other_agent:
  responses_api_agents:
    simple_agent:
      host: 10.0.0.5
      port: 40200
policy_model:
  responses_api_models:
    vllm_model:
      host: 127.0.0.1
      port: 40125
"""


def test_parse_global_config_shape() -> None:
    config = parse_global_config(GLOBAL_CONFIG_YAML)
    assert server_urls(config, "http://10.1.1.1:11000") == {
        "counter_simple_agent": "http://10.1.1.1:40123",
        "other_agent": "http://10.0.0.5:40200",
    }
    assert server_urls(config, "http://h:1", kind="resources_servers") == {
        "counter": "http://127.0.0.1:40124"
    }
    with pytest.raises(ProtocolError):
        parse_global_config({"not": "a string"})
    with pytest.raises(ProtocolError):
        parse_global_config("- just\n- a list\n")


async def test_discovery_routes_rows_by_agent_ref() -> None:
    hits: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/global_config_dict_yaml":
            # FastAPI serialises the str return value as a JSON string
            return httpx.Response(200, content=json.dumps(GLOBAL_CONFIG_YAML).encode())
        hits.append(f"{request.url.host}:{request.url.port}")
        return httpx.Response(200, json=ok_result(json.loads(request.content)))

    async with GymClient(head_url="http://127.0.0.1:11000", transport=httpx.MockTransport(handler)) as client:
        ok = await client.run({**ROW, "agent_ref": {"type": "responses_api_agents", "name": "other_agent"}})
        unknown = await client.run({**ROW, "agent_ref": {"name": "nope"}})
        ambiguous = await client.run(ROW)
    assert ok.ok and hits == ["10.0.0.5:40200"]
    assert unknown.kind == "data" and "nope" in (unknown.reason or "")
    assert ambiguous.kind == "data" and "no agent_ref" in (ambiguous.reason or "")


def test_exactly_one_target() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        GymClient()
    with pytest.raises(ValueError, match="exactly one"):
        GymClient("http://a", head_url="http://b")


async def test_connect_timeout_is_infra_and_retried() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise httpx.ConnectTimeout("connect timed out", request=request)
        return httpx.Response(200, json=ok_result(json.loads(request.content)))

    async with client_for(handler) as client:
        outcome = await client.run(ROW)
    assert outcome.ok and outcome.attempts == 2


async def test_read_timeout_is_a_timeout_not_retried() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ReadTimeout("read timed out", request=request)

    async with client_for(handler) as client:
        outcome = await client.run(ROW)
    assert (outcome.kind, outcome.attempts, calls) == ("timeout", 1, 1)


# Each behaviour: (what the mock agent does on every call for that row, expected kind, expected attempts).
# ``flaky`` fails with 503 on its first call only; ``hang`` never answers within the row deadline.
FAILURE_MIX: dict[str, tuple[str | None, int | None]] = {
    "ok": (None, 1),
    "flaky": (None, 2),
    "e500": ("infra", 2),
    "e429": ("infra", 2),
    "e404": ("data", 1),
    "e422": ("data", 1),
    "garbage": ("data", 1),
    "no_reward": ("data", 1),
    "refused": ("infra", 2),
    "reset": ("infra", 2),
    "hang": ("timeout", 1),
    "not_a_row": ("data", 0),
}


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    behaviours=st.lists(st.sampled_from(sorted(FAILURE_MIX)), max_size=30),
    concurrency=st.integers(min_value=1, max_value=12),
)
async def test_property_failure_mix_every_row_exactly_one_correct_outcome(
    behaviours: list[str], concurrency: int
) -> None:
    """Any mix of successes, retried faults, data faults, transport faults and hangs: one outcome per row,
    classified per docs/design.md ("Reliability rules"), with retries bounded by ``max_attempts``."""
    import asyncio

    calls: dict[int, int] = {}

    async def handler(request: httpx.Request) -> httpx.Response:
        row = json.loads(request.content)
        i = row["i"]
        calls[i] = calls.get(i, 0) + 1
        behaviour = behaviours[i]
        if behaviour == "hang":
            await asyncio.sleep(30)
        if behaviour == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if behaviour == "reset":
            raise httpx.RemoteProtocolError("peer closed connection mid-body", request=request)
        statuses = {"e500": 500, "e429": 429, "e404": 404, "e422": 422}
        if behaviour in statuses:
            return httpx.Response(statuses[behaviour], json="err")
        if behaviour == "flaky" and calls[i] == 1:
            return httpx.Response(503, json="busy")
        if behaviour == "garbage":
            return httpx.Response(200, content=b"{trunc")
        if behaviour == "no_reward":
            return httpx.Response(200, json={**row, "response": {"output": []}})
        return httpx.Response(200, json=ok_result(row, reward=0.5))

    rows: list[Any] = [
        "not a row" if b == "not_a_row" else {"responses_create_params": {}, "i": i}
        for i, b in enumerate(behaviours)
    ]
    async with client_for(handler, max_attempts=2) as client:
        outcomes = [
            o
            async for o in client.run_many(
                iter(rows), concurrency=concurrency, deadline_s=0.5, progress=False
            )
        ]
    assert sorted(o.index for o in outcomes) == list(range(len(rows)))
    for o in outcomes:
        kind, attempts = FAILURE_MIX[behaviours[o.index]]
        assert o.kind == kind, (behaviours[o.index], o.reason)
        assert o.attempts == attempts, (behaviours[o.index], o.attempts)
        assert o.row == rows[o.index]
        assert o.ok == (kind is None) and (o.reward == 0.5 if o.ok else o.reason)
        assert calls.get(o.index, 0) == attempts


async def test_progress_bar_shows_done_failed_rate_and_mean_reward_and_can_be_switched_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        row = json.loads(request.content)
        if row["i"] == 1:
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, json=ok_result(row, reward=0.25 * (row["i"] + 1)))

    rows = [{"responses_create_params": {}, "i": i} for i in range(3)]
    async with client_for(handler) as client:
        quiet = [o async for o in client.run_many(rows, concurrency=1, progress=False)]
        assert capsys.readouterr().err == ""
        shown = [o async for o in client.run_many(rows, concurrency=1, progress=True)]
    err = capsys.readouterr().err
    assert len(quiet) == len(shown) == 3
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert "3/3" in final and "failed=1" in final and "rps=" in final
    assert "reward=0.500" in final  # mean over the two successes: (0.25 + 0.75) / 2


async def test_regression_pool_shards_stay_small_so_the_pool_scan_stays_cheap() -> None:
    """httpcore scans queued requests x connections per request: one 32-connection pool at 32 in
    flight spent ~2,900 is_idle() calls per rollout. The default path is one aiohttp pool now (no
    such scan), bounded by ``max_connections``; the httpx path (a given transport) keeps shards."""
    from gymbridge.client._client import POOL_SHARD_SIZE

    async with GymClient("http://127.0.0.1:9", max_connections=256) as client:
        session = client._aiohttp()
        assert session.connector is not None and session.connector.limit == 256
        assert isinstance(session.cookie_jar, aiohttp.DummyCookieJar)
        assert len(client._pool) == 1  # discovery's httpx client only
    transport = httpx.MockTransport(lambda request: httpx.Response(200))
    async with GymClient("http://127.0.0.1:9", max_connections=256, transport=transport) as client:
        assert len(client._pool) * POOL_SHARD_SIZE >= 256 and POOL_SHARD_SIZE <= 8
        contexts = {id(shard._transport) for shard in client._pool}
    assert len(contexts) == 1  # every shard over the one transport given


async def test_regression_an_agents_cookie_does_not_ride_along_on_the_next_row() -> None:
    """The agent sets its session cookie on every ``/run`` answer (stock parity); httpx's client
    jar kept it and sent it with every later row (and parsed it per reply). Neither path keeps one."""
    from aiohttp import web

    seen: list[str | None] = []

    async def run(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        body = await request.json()
        reply = web.json_response(ok_result(body))
        reply.set_cookie("SimpleAgent___simple_agent", f"s{len(seen)}")
        return reply

    app = web.Application()
    app.router.add_post("/run", run)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with GymClient(f"http://127.0.0.1:{port}") as client:
            for _ in range(2):
                assert (await client.run(dict(ROW))).ok
    finally:
        await runner.cleanup()

    def mock(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Cookie"))
        return httpx.Response(200, json=ok_result(json.loads(request.content)), headers={"Set-Cookie": "a=b"})

    async with client_for(mock) as client:
        for _ in range(2):
            assert (await client.run(dict(ROW))).ok
    assert seen == [None, None, None, None]


async def test_regression_httpcore_finds_sniffio_instead_of_a_failed_import_per_lock() -> None:
    """httpcore imports sniffio on every async lock it sets up; without the package each one was a
    failed import scanning sys.path (~1 ms, a fifth of the bridge's CPU per rollout). A dependency now."""
    import sys

    from httpcore import _synchronization

    assert _synchronization.current_async_library() == "asyncio"
    assert "sniffio" in sys.modules
