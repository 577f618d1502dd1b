"""The README's library example runs as printed: its environment class, then its ``train`` call.

Only what cannot run offline is swapped: the model directory becomes the tiny offline model and the
run is one step of 2 rollouts (text substitutions on the README's own code, checked to apply). The
random tiny model never calls ``look``, so a scripted model plays one episode of the printed class
under the printed config's turn budget: it must reach an answer after ``look`` and be rewarded.
"""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from PIL import Image

import gymbridge.run
from gymbridge.media import encode_data_url
from gymbridge.run.recipe import episode_turns
from gymbridge.run.userenv import resolve_env
from gymbridge.server import SimpleAgent, start_server
from gymbridge.testing.scripted_model import ScriptedModelServer

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _png(colour: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (56, 56), colour).save(out, format="PNG")
    return out.getvalue()


def _row(colour: str) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": "Which door? Look first."}]},
        "png": encode_data_url(_png(colour), "image/png"),
        "door": colour,
    }


def _readme_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Writes the README's ``my_env.py`` and ``rows.jsonl`` into ``tmp_path`` (the working directory,
    on ``sys.path``); returns the README's ``train`` code with the offline swaps applied."""
    env_code, train_code = _python_blocks()[:2]
    assert env_code.startswith("# my_env.py\n")
    (tmp_path / "my_env.py").write_text(env_code)
    rows = [_row(colour) for colour in ("red", "blue")]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    swaps = {
        '"./qwen2-vl-2b"': '"tiny"',
        '"steps": 200': '"steps": 1',
        '"group_size": 8, "prompts_per_step": 16': '"group_size": 2, "prompts_per_step": 1',
    }
    for old, new in swaps.items():
        assert old in train_code, old
        train_code = train_code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_env", raising=False)  # the import of this test's file
    return train_code


def test_the_readme_library_example_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train_code = _readme_code(tmp_path, monkeypatch)
    namespace: dict[str, Any] = {}
    try:
        exec(compile(train_code, "README.md", "exec"), namespace)  # the README's own code
    finally:
        sys.modules.pop("my_env", None)
    summary = namespace["summary"]
    assert len(summary.env_rewards) == 1 and summary.rollouts_ok == 2 and summary.rollouts_failed == 0
    assert Path(summary.run_dir).resolve().parent == (tmp_path / "runs").resolve()


async def test_regression_the_readme_environment_answers_after_look_and_is_rewarded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The printed class showed the room only through ``look`` and a ``module:Class`` environment had
    one model call per episode: the model called ``look`` and the episode ended before any answer,
    so no rollout could earn a reward. An episode of the printed class under the printed config's
    turn budget (the run's own rule) must reach an answer turn after ``look`` and be rewarded."""
    train_code = _readme_code(tmp_path, monkeypatch)
    given: list[Any] = []

    def record(config: Any, **_: Any) -> Any:  # the README's config, not trained here
        given.append(config)
        return SimpleNamespace(env_rewards=[], run_dir="")

    monkeypatch.setattr(gymbridge.run, "train", record)
    try:
        exec(compile(train_code, "README.md", "exec"), {})
        spec = resolve_env(given[0].env.name)
        turns = episode_turns(given[0], spec)
        script = [{"calls": [{"name": "look", "arguments": {}}]}, "the door is blue"]
        env = await start_server(spec.make_server())
        async with ScriptedModelServer(script) as model:
            agent = await start_server(
                SimpleAgent(resources_url=env.url, model_url=model.url, max_steps=turns)
            )
            try:
                async with (
                    aiohttp.ClientSession() as http,
                    http.post(agent.url + "/run", json=_row("blue")) as r,
                ):
                    assert r.status == 200
                    result = await r.json()
            finally:
                await agent.stop()
                await env.stop()
    finally:
        sys.modules.pop("my_env", None)
    kinds = [item["type"] for item in result["response"]["output"]]
    assert kinds == ["function_call", "function_call_output", "message"], kinds
    assert len(model.requests) == 2 and result["reward"] == 1.0
