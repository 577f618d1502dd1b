"""``gymbridge train --agent-url``: training through genuine nemo-gym ``simple_agent`` (0.7.0).

The stack is a user's deployment: our ``color_pick`` environment in-process, a genuine
``simple_agent`` from ``.venv-gym`` in front of it, and in the genuine config a model server
named ``policy_model`` on a port chosen up front. ``gymbridge train --agent-url ... --model-port
PORT --dataset rows.jsonl`` then starts only the model server on that port (the agent calls it by
name, as in any nemo-gym deployment) and trains on what the genuine agent's ``/run`` returns.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from _genuine import KIND_MODELS, KIND_RESOURCES, GenuineStack, free_port
from _gym_support import MODEL_NAME, ThreadedLoop, add_genuine_simple_agent

import gymbridge.server as server_sdk
from gymbridge.cli import main

pytestmark = [pytest.mark.gym, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def deployment(fixture_loop: ThreadedLoop, gym_log_root: Path) -> Iterator[tuple[GenuineStack, int]]:
    from gymbridge_envs import get_env

    env = fixture_loop.run(server_sdk.start_server(get_env("color_pick").make_server()))
    port = free_port()
    stack = GenuineStack(gym_log_root / "train_genuine_agent")
    stack.add(MODEL_NAME, KIND_MODELS, "vllm_model", port=port, launch=False)  # gymbridge train serves it
    stack.add("ours_color_pick", KIND_RESOURCES, "color_pick", port=env.port, launch=False)
    add_genuine_simple_agent(stack, "train_agent", "ours_color_pick", max_steps=1)
    try:
        stack.start()
        yield stack, port
    finally:
        stack.stop()
        fixture_loop.run(env.stop())


def test_train_through_genuine_simple_agent(
    deployment: tuple[GenuineStack, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gymbridge_envs import get_env

    stack, model_port = deployment
    dataset = tmp_path / "rows.jsonl"
    rows = list(
        get_env("color_pick").generate(4, 3, colors="red,blue", img_size=56, reveal="prompt", blank=False)
    )
    dataset.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "--agent-url", stack.url("train_agent"),
            "--model-port", str(model_port),
            "--dataset", str(dataset),
            "--steps", "2",
            "--prompts", "2",
            "--group-size", "4",
            "--run-dir", str(run_dir),
            "--no-progress",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out + stack.log_tails()
    assert f"model http://127.0.0.1:{model_port}" in out and f"agent {stack.url('train_agent')}" in out
    assert "environment" not in out.split("servers:")[1].splitlines()[0]  # the agent's env, not ours
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rollouts_ok"] == 8 and r["rollouts_failed"] == 0 for r in records), records
    assert all(r["num_loss_tokens"] > 0 for r in records)  # the genuine agent's results carry our token ids
    assert all(r["media_tensors"].get("image") for r in records)  # the rows' images reached training
    assert (run_dir / "failures.jsonl").read_text() == ""
