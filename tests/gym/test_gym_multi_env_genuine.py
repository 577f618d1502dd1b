"""``gymbridge train --head-url``: one run over two environments behind a genuine nemo-gym 0.7.0 head server.

The stack is a user's multi-environment deployment: genuine ``circle_click`` (shipped in the 0.7.0
wheel, its own ``data/example.jsonl`` rows) and our ``color_pick`` (in-process), each behind a
genuine ``simple_agent``, the genuine head server listing both, and in the genuine config a model
server named ``policy_model`` on a port chosen up front. The dataset interleaves both
environments' rows, each with the ``agent_ref`` of its agent (NeMo Gym's multi-environment
dataset); ``gymbridge.run.train`` with ``env.head_url`` starts only the model server on that port,
discovers the agents through the head and routes every row to the agent it names. Every
``metrics.jsonl`` record then carries both environments' keys.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from _genuine import KIND_MODELS, KIND_RESOURCES, GenuineStack, free_port, gym_site_packages
from _gym_support import MODEL_NAME, ThreadedLoop, add_genuine_simple_agent

import gymbridge.server as server_sdk
from gymbridge.client import agent_ref, env_of_row
from gymbridge.run import load_run_config, train

pytestmark = [pytest.mark.gym, pytest.mark.timeout(600)]

OURS, GENUINE = "color_pick_agent", "circle_click_agent"
G = 2


@pytest.fixture(scope="module")
def head_deployment(fixture_loop: ThreadedLoop, gym_log_root: Path) -> Iterator[tuple[GenuineStack, int]]:
    from gymbridge_envs import get_env

    env = fixture_loop.run(server_sdk.start_server(get_env("color_pick").make_server()))
    port = free_port()
    stack = GenuineStack(gym_log_root / "multi_env_genuine", with_head=True)
    stack.add(MODEL_NAME, KIND_MODELS, "vllm_model", port=port, launch=False)  # the run serves it
    stack.add("ours_color_pick", KIND_RESOURCES, "color_pick", port=env.port, launch=False)
    add_genuine_simple_agent(stack, OURS, "ours_color_pick", max_steps=1)
    stack.add("circle_click", KIND_RESOURCES, "circle_click", domain="other")
    add_genuine_simple_agent(stack, GENUINE, "circle_click", max_steps=1)
    try:
        stack.start()
        yield stack, port
    finally:
        stack.stop()
        fixture_loop.run(env.stop())


def _mixed_rows() -> list[dict[str, Any]]:
    """Two rows of each environment, interleaved, each naming its agent."""
    from gymbridge_envs import get_env

    ours = get_env("color_pick").generate(2, 3, colors="red,blue", img_size=56)
    example = gym_site_packages() / "resources_servers" / "circle_click" / "data" / "example.jsonl"
    genuine = [json.loads(line) for line in example.read_text().splitlines()[:2]]
    rows: list[dict[str, Any]] = []
    for mine, theirs in zip(ours, genuine, strict=True):
        rows += [{**mine, "agent_ref": agent_ref(OURS)}, {**theirs, "agent_ref": agent_ref(GENUINE)}]
    return rows


def test_a_run_over_a_genuine_head_server_reports_each_environment(
    head_deployment: tuple[GenuineStack, int], tmp_path: Path
) -> None:
    stack, model_port = head_deployment
    rows = _mixed_rows()
    dataset = tmp_path / "rows.jsonl"
    dataset.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    run_dir = tmp_path / "run"
    cfg = load_run_config(
        [],
        [("rollout.max_tokens", 8)],
        {
            "head_url": stack.url("head_server"),
            "model_port": model_port,
            "dataset": str(dataset),
            "steps": 2,
            "prompts_per_step": 2,
            "group_size": G,
            "run_dir": str(run_dir),
        },
    )
    out = io.StringIO()
    train(cfg, out=out)
    text = out.getvalue()
    assert f"head server {stack.url('head_server')}: 2 agent(s): " in text, text + stack.log_tails()
    assert f"{GENUINE} {stack.url(GENUINE)}" in text and f"{OURS} {stack.url(OURS)}" in text
    assert f"model http://127.0.0.1:{model_port}" in text

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2], text + stack.log_tails()
    for r in records:  # each step: one row of each environment, each group run by its row's agent
        for env in (OURS, GENUINE):
            assert r[f"env/{env}/rollouts_ok"] == G and r[f"env/{env}/rollouts_failed"] == 0, r
            assert r[f"env/{env}/tokens"] > 0 and 0.0 <= r[f"env/{env}/reward_mean"] <= 1.0
        assert {env_of_row(rows[i]) for i in r["task_indices"]} == {OURS, GENUINE}
        assert r["media_tensors"].get("image")  # both environments' images reached training
    assert (run_dir / "failures.jsonl").read_text() == ""
    assert f"  env {GENUINE}: reward " in text and f"  env {OURS}: reward " in text
