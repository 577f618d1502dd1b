"""Conformance: genuine simple_agent + genuine vllm_model (nemo-gym 0.7.0) in front of our model server.

Stack per environment (counter, circle_click — gymbridge's own environments):
genuine ``simple_agent`` -> genuine ``vllm_model`` (``return_token_id_information: true``,
``uses_reasoning_parser: true``) -> gymbridge ``ModelServer`` (tiny Qwen2-VL, tool calls
forced by a ``ScriptedGenerator`` following the environment's oracle) -> our environment.
The results must score 1.0, be contiguous, and parse with ``from_gym_result``.
Skipped when ``.venv-gym`` (scripts/setup_gym_venv.sh) is absent.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "tests" / "gym"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

pytestmark = [pytest.mark.gym, pytest.mark.integration]

genuine = pytest.importorskip(
    "_genuine", reason="tests/gym/_genuine.py (the genuine-server launcher) is missing"
)
oracles = pytest.importorskip("_oracles", reason="tests/gym/_oracles.py is missing")


class LoopThread:
    """An event loop in a daemon thread, for in-process servers next to blocking test code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout_s: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def script_tokens(gen: Any, entries: list[Any]) -> list[list[int]]:
    """Oracle entries (tool calls or final text) -> the Hermes-format tokens the model would emit."""
    out = []
    for entry in entries:
        if isinstance(entry, str):
            text = entry
        else:
            text = "\n".join(
                "<tool_call>\n"
                + json.dumps({"name": c["name"], "arguments": c["arguments"]})
                + "\n</tool_call>"
                for c in entry["calls"]
            )
        ids = gen.tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append([int(t) for t in ids] + [gen.codec.end_of_turn_id])
    return out


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    problem = genuine.gym_venv_problem()
    if problem:
        pytest.skip(problem)
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.mark.parametrize("env_name", ["counter", "circle_click"])
def test_genuine_vllm_model_and_simple_agent_on_our_model_server(
    loop_thread: LoopThread, env_name: str, tmp_path: Path
) -> None:
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.generation.scripted import ScriptedGenerator
    from gymbridge.generation.server import ModelServer, ModelServerConfig
    from gymbridge.server import start_server
    from gymbridge.trajectory import from_gym_result
    from gymbridge_envs.registry import get_env

    spec = get_env(env_name)
    row = spec.make_row(0, 0)
    tiny = HFGenerator.tiny(0)
    scripted = ScriptedGenerator(tiny, script_tokens(tiny, getattr(oracles, env_name)(row)))
    config = ModelServerConfig(
        model_name="tiny", max_model_len=tiny.max_model_len, default_max_tokens=16, batching=False
    )
    model = ModelServer(scripted, config=config)

    async def start() -> Any:
        await model.start()
        return await start_server(spec.make_server())

    env = loop_thread.run(start())
    stack = genuine.GenuineStack(tmp_path / "logs")
    stack.add(
        "policy_model",
        genuine.KIND_MODELS,
        "vllm_model",
        base_url=f"{model.url}/v1",
        api_key="none",
        model="tiny",
        return_token_id_information=True,
        uses_reasoning_parser=True,
    )
    stack.add(env_name, genuine.KIND_RESOURCES, env_name, port=env.port, launch=False, domain="other")
    stack.add(
        "agent",
        genuine.KIND_AGENTS,
        "simple_agent",
        resources_server=genuine.ref(genuine.KIND_RESOURCES, env_name),
        model_server=genuine.ref(genuine.KIND_MODELS, "policy_model"),
        max_steps=8,
    )
    try:
        with genuine.running(stack):
            reply = httpx.post(f"{stack.url('agent')}/run", json=row, timeout=180)
    finally:
        loop_thread.run(env.stop())
        loop_thread.run(model.stop())
    assert reply.status_code == 200, reply.text[:2000]
    result = reply.json()
    assert result["reward"] == 1.0, json.dumps(result)[:2000]
    traj = from_gym_result(result)
    assert traj.num_segments == 1  # contiguous: every turn's prompt extends the previous one
    assert len(traj.turns) == len(scripted.inputs_seen) >= 2
    if env_name == "circle_click":
        assert len(scripted.inputs_seen[0].multi_modal_data["image"]) == 1
