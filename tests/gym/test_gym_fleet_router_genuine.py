"""A generator fleet serves genuine nemo-gym 0.7.0 ``simple_agent``: its policy model is the router.

The stack is a user's deployment (as in ``test_gym_train_genuine_agent.py``): our ``color_pick``
environment in-process, a genuine ``simple_agent`` in front of it, and in the genuine config a
model server named ``policy_model`` on a port chosen up front. The run (``gymbridge.run.train``,
``env.agent_url``) puts its fleet's router on that port (``generator.port``) with two model-server
children behind it (``generator.placement: process``, ``generator.replicas: 2``), so every
generation the genuine agent asks for goes through the router to one of the replicas.

The environment is single-turn (``max_steps=1``: no existing genuine test drives a multi-turn
environment with the run's model), so each rollout makes one model call and the cookie that keeps a
conversation's turns on one replica is not observed here (``tests/generation/test_fleet_router.py``
covers it).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from _genuine import KIND_MODELS, KIND_RESOURCES, GenuineStack, free_port
from _gym_support import MODEL_NAME, ThreadedLoop, add_genuine_simple_agent

import gymbridge.server as server_sdk
from gymbridge.run import load_run_config, train

pytestmark = [pytest.mark.gym, pytest.mark.timeout(600)]

STEPS, PROMPTS, G = 2, 2, 4


@pytest.fixture(scope="module")
def deployment(fixture_loop: ThreadedLoop, gym_log_root: Path) -> Iterator[tuple[GenuineStack, int]]:
    from gymbridge_envs import get_env

    env = fixture_loop.run(server_sdk.start_server(get_env("color_pick").make_server()))
    port = free_port()
    stack = GenuineStack(gym_log_root / "fleet_router_genuine")
    stack.add(MODEL_NAME, KIND_MODELS, "vllm_model", port=port, launch=False)  # the run's router
    stack.add("ours_color_pick", KIND_RESOURCES, "color_pick", port=env.port, launch=False)
    add_genuine_simple_agent(stack, "fleet_agent", "ours_color_pick", max_steps=1)
    try:
        stack.start()
        yield stack, port
    finally:
        stack.stop()
        fixture_loop.run(env.stop())


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_genuine_simple_agent_generates_through_a_two_replica_fleet(
    deployment: tuple[GenuineStack, int], tmp_path: Path
) -> None:
    from gymbridge_envs import get_env

    stack, router_port = deployment
    rows = list(
        get_env("color_pick").generate(4, 3, colors="red,blue", img_size=56, reveal="prompt", blank=False)
    )
    dataset = tmp_path / "rows.jsonl"
    dataset.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    run_dir = tmp_path / "run"
    cfg = load_run_config(
        [],
        [
            ("rollout.max_tokens", 8),
            ("shaping.kind", "token_rate"),  # reward variance in every group: every step trains
            ("generator.placement", "process"),
            ("generator.replicas", 2),
        ],
        {
            "agent_url": stack.url("fleet_agent"),
            "model_port": router_port,
            "dataset": str(dataset),
            "steps": STEPS,
            "prompts_per_step": PROMPTS,
            "group_size": G,
            "run_dir": str(run_dir),
        },
    )
    out = io.StringIO()
    summary = train(cfg, out=out)
    text = out.getvalue()
    logs = text + stack.log_tails()
    assert "fleet of 2 model servers" in text, logs
    assert f"model http://127.0.0.1:{router_port}" in text and f"agent {stack.url('fleet_agent')}" in text

    records = _records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), logs
    assert summary.rollouts_failed == 0, logs
    assert all(r["rollouts_ok"] == PROMPTS * G and r["rollouts_failed"] == 0 for r in records), records
    assert _records(run_dir / "failures.jsonl") == []
    for r in records:  # on-policy: every step trained on its replica's logprobs of the current weights
        assert r.get("skipped") is None and abs(r["ratio_mean"] - 1.0) < 1e-3, r
        assert r["num_loss_tokens"] > 0  # the genuine agent's results carry the replicas' token ids
        for i in (0, 1):
            assert r[f"generator/replica_{i}/policy_version"] == r["policy_version"], r
    served = [sum(r[f"generator/replica_{i}/requests"] for r in records) for i in (0, 1)]
    assert all(n > 0 for n in served), served  # both replicas served the genuine agent's calls
    assert sum(served) >= STEPS * PROMPTS * G, served  # every rollout's generation went through the router
    assert sum(r[f"generator/replica_{i}/errors"] for r in records for i in (0, 1)) == 0
