"""Lossless round trip of the example rows and rollouts shipped with genuine NeMo Gym 0.7.0.

Reads the data files inside the conformance venv's nemo-gym wheel (``.venv-gym``; or
``GYMBRIDGE_NEMO_GYM_SRC``), through the ``gym_wheel_data`` fixture: skipped with the reason
when absent, a failure in CI (``GYMBRIDGE_REQUIRE_GYM=1``). Only the first rows of a few files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gymbridge import protocol as p

FILES = [
    "resources_servers/circle_click/data/example.jsonl",
    "resources_servers/circle_click/data/example_rollouts.jsonl",
    "resources_servers/example_multi_turn_gymnasium/data/example_rollouts.jsonl",
    "resources_servers/example_tool_call_multireward/data/example_rollouts.jsonl",
    "resources_servers/competitive_coding_challenges/data/example_rollouts.jsonl",
    "resources_servers/swemer_oml/data/example_rollouts.jsonl",
    # transitions-form output (aviary_agent return_transitions): a list of item lists
    "environments/aviary_bixbench/data/example_rollouts.jsonl",
    # token fields with empty lists and ``routed_experts: null`` on every item
    "environments/hermes_math/data/example_rollouts.jsonl",
    "benchmarks/automationbench/data/example_rollouts.jsonl",
    # reward is the mean of its components, not their sum
    "resources_servers/vibench/data/example_rollouts.jsonl",
    # rows whose responses_create_params the agent fills in (empty, or absent altogether)
    "resources_servers/aviary/data/example.jsonl",
    "resources_servers/toolsandbox/data/example.jsonl",
    "resources_servers/nemo_user_sim/data/example.jsonl",
]


@pytest.mark.parametrize("rel", FILES)
def test_genuine_rows_and_results_round_trip(rel: str, gym_wheel_data: Path) -> None:
    path = gym_wheel_data / rel
    assert path.is_file(), f"{rel} is not in the nemo-gym 0.7.0 wheel"
    with path.open("rb") as fh:
        lines = [line for _, line in zip(range(3), fh, strict=False)]
    for line in lines:
        expected = json.loads(line)
        is_result = "response" in expected and "reward" in expected
        parsed = p.parse_run_result(line) if is_result else p.parse_run_request(line)
        assert p.dump(parsed) == expected
