"""ResourcesServer: routes, status codes (stock Gym parity), sessions, schemas, verify, gymnasium."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import aiohttp
import pytest
from pydantic import BaseModel, Field

from gymbridge.server import (
    HttpError,
    ResourcesServer,
    RunningServer,
    Session,
    VerifyResult,
    start_server,
    tool,
)
from gymbridge.server.examples import CounterEnv, counter_rows
from gymbridge_envs.circle_click.server import CircleClickServer
from gymbridge_envs.counter.server import CounterServer

STOCK_TOOLS = json.loads((Path(__file__).parent / "fixtures" / "stock_row_tools.json").read_text())

COOKIE = "CounterEnv___CounterEnv"


class Point(BaseModel):
    x: int
    y: int = Field(ge=0, description="row")


class SchemaEnv(ResourcesServer):
    @tool
    async def plain(
        self,
        count: Annotated[int, Field(description="how many")],
        label: str = "a",
        ratio: float | None = None,
    ) -> str:
        """Do a plain thing.

        Details that are not part of the description.
        """
        return f"{count}:{label}:{ratio}"

    @tool(name="point", description="Take a point.")
    def take_point(self, point: Point, session: Session) -> dict[str, Any]:
        session.state["last"] = point.model_dump()
        return {"sum": point.x + point.y}

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        return VerifyResult(reward=0.5, reward_components={"a": 0.25, "b": 0.5})


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, cookie: str | None = None
) -> tuple[int, Any, str]:
    headers = {"Cookie": cookie} if cookie else {}
    kwargs: dict[str, Any] = {"data": body} if isinstance(body, (bytes, str)) else {"json": body}
    async with http.post(url, headers=headers, **kwargs) as resp:
        text = await resp.text()
        set_cookie = resp.cookies.get(COOKIE)
        try:
            parsed = await resp.json(content_type=None)
        except ValueError:
            parsed = text
        return resp.status, parsed, (set_cookie.value if set_cookie else "")


def test_schema_is_derived_from_type_hints() -> None:
    tools = {t["name"]: t for t in SchemaEnv.function_tools()}
    plain = tools["plain"]
    assert plain["type"] == "function"
    assert plain["description"] == "Do a plain thing."
    params = plain["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["count"]
    assert params["properties"]["count"] == {"description": "how many", "type": "integer"}
    assert params["properties"]["label"]["default"] == "a"
    assert params["additionalProperties"] is False
    # optional arguments cannot be strict (OpenAI strict mode requires every property)
    assert plain["strict"] is False
    point = tools["point"]
    assert "session" not in point["parameters"]["properties"]
    assert point["description"] == "Take a point."
    assert set(point["parameters"]["required"]) == {"x", "y"}
    assert point["strict"] is True
    assert point["parameters"]["additionalProperties"] is False
    assert "title" not in json.dumps(point)


def test_published_schemas_match_stock_rows_strict_closed_no_titles() -> None:
    """Regression (issue 5 review): schemas were ``strict: false`` with pydantic titles; stock is strict."""
    stock_counter_tools = STOCK_TOOLS["example_session_state_mgmt"]
    ours = {t["name"]: t for t in CounterServer.function_tools()}
    for stock in stock_counter_tools:
        mine = ours[stock["name"]]
        assert mine["strict"] is stock["strict"] is True
        params = mine["parameters"]
        assert {k: v for k, v in params.items() if k != "properties"} == {
            k: v for k, v in stock["parameters"].items() if k != "properties"
        }
        assert {
            name: {k: v for k, v in p.items() if k != "description"}
            for name, p in params["properties"].items()
        } == {
            name: {k: v for k, v in p.items() if k != "description"}
            for name, p in stock["parameters"]["properties"].items()
        }
    stock_click = STOCK_TOOLS["circle_click"][0]
    click = CircleClickServer.function_tools()[0]
    assert click["strict"] is True
    assert sorted(click["parameters"]) == sorted(stock_click["parameters"])
    assert click["parameters"]["required"] == stock_click["parameters"]["required"]


def test_tool_name_cannot_shadow_a_protocol_endpoint() -> None:
    with pytest.raises(TypeError, match="collides"):

        class Bad(ResourcesServer):
            @tool
            async def verify_me(self) -> str:  # pragma: no cover - never called
                return ""

            @tool(name="verify")
            async def other(self) -> str:  # pragma: no cover - never called
                return ""


async def test_health_endpoints_and_prefix(counter_env: RunningServer, http: aiohttp.ClientSession) -> None:
    for path in ("/", "/livez", "/healthz", "/readyz", "/ng-rollout/r-1.a/healthz"):
        async with http.get(counter_env.url + path) as resp:
            assert resp.status == 200, path
            assert await resp.json() == {"status": "ok"}


async def test_stock_status_codes(counter_env: RunningServer, http: aiohttp.ClientSession) -> None:
    url = counter_env.url
    status, body, _ = await post(http, url + "/increment", {"amount": "many"})
    assert status == 422 and body["detail"][0]["loc"] == ["body", "amount"]
    status, body, _ = await post(http, url + "/increment", {"amount": 1000})
    assert status == 422 and "less than or equal" in body["detail"][0]["msg"]
    status, body, _ = await post(http, url + "/no_such_tool", {})
    assert (status, body) == (404, {"detail": "Not Found"})
    status, body, _ = await post(http, url + "/explode", {"reason": "kaput"})
    assert (status, body) == (500, "RuntimeError('kaput')")
    status, body, _ = await post(http, url + "/increment", b"{not json")
    assert status == 400 and "not valid JSON" in body["detail"]
    status, body, _ = await post(http, url + "/verify", [1, 2])
    assert status == 422
    status, body, _ = await post(http, url + "/verify", {"responses_create_params": {}})
    assert status == 422 and body["detail"][0]["loc"] == ["body", "response"]
    async with http.get(url + "/increment") as resp:
        assert resp.status == 405
    # none of that killed the server
    async with http.get(url + "/") as resp:
        assert resp.status == 200


async def test_sessions_are_per_cookie_and_survive_other_servers_cookies(
    counter_env: RunningServer, http: aiohttp.ClientSession
) -> None:
    url = counter_env.url
    _, _, cookie_a = await post(http, url + "/seed_session", {"responses_create_params": {}, "start": 5})
    _, _, cookie_b = await post(http, url + "/seed_session", {"responses_create_params": {}, "start": 100})
    assert cookie_a and cookie_b and cookie_a != cookie_b
    # the verify call carries several servers' cookies in one header; ours is found among them
    mixed = f"SimpleAgent___agent=xyz; {COOKIE}={cookie_a}; VLLMModel___policy=abc"
    status, body, _ = await post(http, url + "/increment", {"amount": 2}, cookie=mixed)
    assert (status, body) == (200, {"count": 7})
    status, body, _ = await post(http, url + "/ng-rollout/abc/increment", {}, cookie=f"{COOKIE}={cookie_b}")
    assert (status, body) == (200, {"count": 101})


async def test_session_store_is_bounded(http: aiohttp.ClientSession) -> None:
    server = CounterEnv(max_sessions=3)
    async with await start_server(server) as running:
        for _ in range(10):
            await post(http, running.url + "/seed_session", {"responses_create_params": {}})
        assert server.num_sessions == 3


async def test_verify_echoes_row_and_checks_components(http: aiohttp.ClientSession) -> None:
    row = counter_rows(1, seed=3)[0]
    async with await start_server(CounterEnv()) as running:
        _, _, cookie = await post(http, running.url + "/seed_session", row)
        for _ in range(row["target"]):
            await post(http, running.url + "/increment", {}, cookie=f"{COOKIE}={cookie}")
        response = {"output": [{"type": "message", "role": "assistant", "content": []}]}
        status, body, _ = await post(
            http, running.url + "/verify", {**row, "response": response}, cookie=f"{COOKIE}={cookie}"
        )
    assert status == 200
    assert body["reward"] == pytest.approx(1.0)
    assert body["reward_components"] == {"count": 0.8, "answered": 0.2}
    assert (
        body["target"] == row["target"] and body["responses_create_params"] == row["responses_create_params"]
    )
    assert (
        body["mask_sample"] is False and body["failure_kind"] is None and body["final_count"] == row["target"]
    )

    # components that do not sum to the reward are a server bug: 500, not a silently wrong reward
    async with await start_server(SchemaEnv()) as running:
        status, body, _ = await post(
            http, running.url + "/verify", {"responses_create_params": {}, "response": {"output": []}}
        )
    assert status == 500 and "reward_components sum" in body


async def test_pydantic_model_tool_and_sync_tool(http: aiohttp.ClientSession) -> None:
    async with await start_server(SchemaEnv()) as running:
        status, body, _ = await post(http, running.url + "/point", {"x": 2, "y": 3})
        assert (status, body) == (200, {"sum": 5})
        status, body, _ = await post(http, running.url + "/point", {"x": 2, "y": -1})
        assert status == 422
        status, body, _ = await post(http, running.url + "/plain", {"count": "3"})
        assert (status, body) == (200, "3:a:None")


async def test_aggregate_metrics_shape(counter_env: RunningServer, http: aiohttp.ClientSession) -> None:
    responses = [
        {"_ng_task_index": 0, "reward": 1.0},
        {"_ng_task_index": 0, "reward": 0.0},
        {"_ng_task_index": 1, "reward": 1.0, "mask_sample": True},
    ]
    status, body, _ = await post(
        http, counter_env.url + "/aggregate_metrics", {"verify_responses": responses}
    )
    assert status == 200
    assert set(body) == {"group_level_metrics", "agent_metrics", "key_metrics"}
    # as 0.7.0 aggregates: a masked sample's reward is not a measurement, so no mean includes it
    assert body["agent_metrics"]["mean/reward"] == pytest.approx(1 / 2)
    assert body["agent_metrics"]["num_rollouts"] == 3 and body["agent_metrics"]["num_masked"] == 1
    groups = {g["_ng_task_index"]: g for g in body["group_level_metrics"]}
    assert groups[0]["mean/reward"] == 0.5 and set(groups) == {0}


async def test_tool_image_output_is_marked_parts(
    counter_env: RunningServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(counter_env.url + "/snapshot", json={}) as resp:
        assert resp.headers["X-Gymbridge-Tool-Output"] == "parts"
        parts = await resp.json()
    assert parts[0] == {"type": "input_text", "text": "count is 0"}
    assert parts[1]["type"] == "input_image" and parts[1]["image_url"].startswith("data:image/png;base64,")
    assert parts[1]["detail"] == "auto"


async def test_gymnasium_reset_step_close(step_env: RunningServer, http: aiohttp.ClientSession) -> None:
    row = {"responses_create_params": {"input": []}, "target": 1}

    def answer(text: str) -> dict[str, Any]:
        return {
            "output": [
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
            ]
        }

    async with http.post(step_env.url + "/reset", json=row) as resp:
        first = await resp.json()
        cookie = f"StepCounterEnv___StepCounterEnv={resp.cookies['StepCounterEnv___StepCounterEnv'].value}"
    assert isinstance(first["observation"], str) and "count=0" in first["observation"]
    assert first["observation_content"][1]["type"] == "input_image"
    async with http.post(
        step_env.url + "/step",
        json={**row, "response": answer("<action>inc</action>")},
        headers={"Cookie": cookie},
    ) as resp:
        step = await resp.json()
    assert step["reward"] == 0.0 and step["terminated"] is False and "count=1" in step["observation"]
    async with http.post(
        step_env.url + "/step",
        json={**row, "response": answer("<action>stop</action>")},
        headers={"Cookie": cookie},
    ) as resp:
        step = await resp.json()
    assert step["reward"] == 1.0 and step["terminated"] is True


async def test_http_error_from_author_code(http: aiohttp.ClientSession) -> None:
    class Strict(ResourcesServer):
        async def seed_session(self, session: Session, row: dict[str, Any]) -> dict[str, Any] | None:
            raise HttpError(409, {"detail": "nope"})

    async with await start_server(Strict()) as running:
        status, body, _ = await post(http, running.url + "/seed_session", {})
    assert (status, body) == (409, {"detail": "nope"})


async def test_many_concurrent_bad_requests_do_not_kill_the_server(
    counter_env: RunningServer, http: aiohttp.ClientSession
) -> None:
    bodies: list[Any] = [b"", b"\xff\xfe", b"[", b"null", {"amount": None}, {"amount": [1]}, b'"str"'] * 10
    results = await asyncio.gather(*(post(http, counter_env.url + "/increment", b) for b in bodies))
    assert all(400 <= status < 500 for status, _, _ in results), {s for s, _, _ in results}
    status, body, _ = await post(http, counter_env.url + "/increment", {"amount": 1})
    assert (status, body) == (200, {"count": 1})
