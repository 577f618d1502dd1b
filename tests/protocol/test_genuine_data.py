"""Lossless round trip of the example rows and rollouts shipped with genuine NeMo Gym 0.7.0.

Runs when the unpacked wheel is present (``GYMBRIDGE_NEMO_GYM_SRC``, default
``/tmp/nemo_gym_src``); skipped otherwise. Only the first rows of a few files, to stay fast.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gymbridge import protocol as p

SRC = Path(os.environ.get("GYMBRIDGE_NEMO_GYM_SRC", "/tmp/nemo_gym_src"))
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
]


@pytest.mark.parametrize("rel", FILES)
def test_genuine_rows_and_results_round_trip(rel: str) -> None:
    path = SRC / rel
    if not path.exists():
        pytest.skip(f"genuine NeMo Gym data not found at {path}")
    with path.open("rb") as fh:
        lines = [line for _, line in zip(range(3), fh, strict=False)]
    for line in lines:
        expected = json.loads(line)
        is_result = "response" in expected and "reward" in expected
        parsed = p.parse_run_result(line) if is_result else p.parse_run_request(line)
        assert p.dump(parsed) == expected
