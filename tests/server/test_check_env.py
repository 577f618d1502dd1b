"""check_env: passes on well-behaved environments, lists every problem of a broken one."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from gymbridge.server import (
    CheckEnvError,
    ResourcesServer,
    RunningServer,
    Session,
    check_env,
    example_arguments,
    start_server,
    tool,
)
from gymbridge.server.examples import CounterEnv, counter_rows, step_counter_rows


async def test_passes_on_tool_env(counter_env: RunningServer) -> None:
    report = await check_env(
        counter_env.url, counter_rows(3), skip_tools=["explode"], generate=lambda seed: counter_rows(4, seed)
    )
    assert report.ok and len(report.rewards) == 3
    assert any("published tool schema" in line for line in report.passed)


async def test_passes_on_gymnasium_env(step_env: RunningServer) -> None:
    report = await check_env(step_env.url, step_counter_rows(2), answer_text="<action>stop</action>")
    assert report.ok


class Broken(ResourcesServer):
    """Nondeterministic seed, a crashing tool, a NaN-free but non-echoing verify."""

    counter = 0

    @tool
    async def crash(self, n: int) -> str:
        raise ValueError("author bug")

    async def seed_session(self, session: Session, row: dict[str, Any]) -> dict[str, Any] | None:
        Broken.counter += 1
        return {"nonce": Broken.counter}

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
        return {"reward": 1.0, "reward_components": {"a": 0.5}}


async def test_lists_every_problem() -> None:
    rows = [{"responses_create_params": {"input": "x", "tools": [{"type": "function", "name": "ghost"}]}}]
    ticks = itertools.count()
    async with await start_server(Broken()) as running:
        with pytest.raises(CheckEnvError) as info:
            await check_env(running.url, rows, generate=lambda seed: [{"n": next(ticks)}])
    problems = "\n".join(info.value.problems)
    assert "seed_session is not deterministic" in problems
    assert "tool crash with valid arguments" in problems
    assert "offers tool 'ghost'" in problems
    assert "reward_components sum to 0.5, reward is 1.0" in problems  # verify answered 500
    assert "generate(seed=0) is not deterministic" in problems
    assert len(info.value.problems) >= 5


async def test_unreachable_server_is_a_problem_not_a_hang() -> None:
    with pytest.raises(CheckEnvError, match="unreachable"):
        await check_env("http://127.0.0.1:9", counter_rows(1), timeout_s=2)


def test_example_arguments_satisfy_schemas() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 3},
            "kind": {"enum": ["a", "b"]},
            "box": {"type": "array", "items": {"type": "number"}, "minItems": 4},
            "opt": {"type": "string"},
        },
        "required": ["n", "kind", "box"],
    }
    assert example_arguments(schema) == {"n": 3, "kind": "a", "box": [0.0, 0.0, 0.0, 0.0]}


class LooseStrict(CounterEnv):
    """Publishes a hand-written schema that claims strict mode but leaves the object open."""

    @classmethod
    def function_tools(cls) -> list[dict[str, Any]]:
        tools = super().function_tools()
        for t in tools:
            t["parameters"].pop("additionalProperties", None)
            t["strict"] = True
        return tools


async def test_strict_tool_with_an_open_schema_is_a_problem() -> None:
    async with await start_server(LooseStrict()) as running:
        with pytest.raises(CheckEnvError) as info:
            await check_env(running.url, counter_rows(1))
    assert any("strict is true but the schema is not strict-mode valid" in p for p in info.value.problems)
