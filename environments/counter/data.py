"""counter task data: text-only tasks whose answer lives in server-side session state.

Each row asks the model to add a few numbers to a counter and read it back. The counter
starts at ``initial_count`` (set by ``/seed_session``, invisible to the model) and the
verifier compares the session's final value with ``expected_count``. Tool names, argument
names and the row shape are stock Gym's ``example_session_state_mgmt``, so either
environment can serve the other's data and the stock ``simple_agent`` drives ours.

Invariant: ``expected_count == initial_count + sum(increments)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from pydantic import Field

from gymbridge_envs._common import row_rng

ENV_NAME = "counter"

SYSTEM_PROMPT = (
    "You operate a counter through tools. Do exactly what the user asks, one tool call per step, "
    "then reply with the final count."
)


MAX_TURNS = 4
"""Model calls an episode may take (a run's ``rollout.max_turns`` when it sets none)."""
SMOKE_PARAMS: dict[str, Any] = {}
"""Generator parameters of ``gymbridge smoke run --env counter`` (small, for the tiny model)."""


def tools() -> list[dict[str, Any]]:
    """The function tools the server publishes: one source of truth, the server's typed tools."""
    from gymbridge_envs.counter.server import CounterServer

    return CounterServer.function_tools()


def make_row(
    seed: int,
    index: int,
    *,
    min_ops: Annotated[int, Field(ge=1)] = 1,
    max_ops: Annotated[int, Field(ge=1)] = 3,
    max_initial: Annotated[int, Field(ge=0)] = 10,
    max_step: Annotated[int, Field(ge=1)] = 9,
) -> dict[str, Any]:
    """Row ``index`` of the dataset generated with ``seed``."""
    rng = row_rng(ENV_NAME, seed, index)
    initial = rng.randint(0, max_initial)
    increments = [rng.randint(1, max_step) for _ in range(rng.randint(min_ops, max_ops))]
    instruction = " then ".join(f"add {k}" for k in increments) + " then get the count"
    return {
        "responses_create_params": {
            "input": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": instruction},
            ],
            "tools": tools(),
        },
        "initial_count": initial,
        "increments": increments,
        "expected_count": initial + sum(increments),
    }


def generate(n: int, seed: int = 0, **params: Any) -> Iterator[dict[str, Any]]:
    for index in range(n):
        yield make_row(seed, index, **params)
