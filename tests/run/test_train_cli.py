"""``gymbridge train`` on a user's own environment class, dataset and model, with a real user's defaults.

The environment is defined here (:class:`VowelEnv`) and named to the CLI as ``module:Class``
(this test module's own import name); the run starts it next to our agent and model server.
Bad input (a dataset line, a class that is no ResourcesServer, missing vLLM) is a ConfigError
that names what is wrong, raised before any server starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from run_helpers import quiet_train

from gymbridge.cli import main
from gymbridge.errors import ConfigError
from gymbridge.run import RunConfig, load_run_config
from gymbridge.run.userenv import read_dataset, resolve_env
from gymbridge.server import ResourcesServer
from gymbridge.server._base import Session
from gymbridge.server._resources import VerifyResult

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

VERIFIED: list[float] = []
"""Every reward :class:`VowelEnv` handed out (the run starts it in this process)."""


class VowelEnv(ResourcesServer):
    """A user's environment: pays 1.0 when the answer starts with the row's letter class."""

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        text = "".join(
            part.get("text", "")
            for item in response["output"]
            if isinstance(item, dict) and item.get("type") == "message"
            for part in item.get("content", [])
            if isinstance(part, dict)
        )
        reward = 1.0 if text[:1].lower() in row["letters"] else 0.0
        VERIFIED.append(reward)
        return VerifyResult(reward=reward)


class NotAServer:
    pass


def rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "responses_create_params": {"input": [{"role": "user", "content": f"Say a word. ({i})"}]},
            "letters": "aeiou" if i % 2 else "bcdfg",
        }
        for i in range(n)
    ]


def write_rows(path: Path, items: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in items))
    return path


def test_train_cli_on_an_environment_class_defined_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = write_rows(tmp_path / "rows.jsonl", rows(8))
    run_dir = tmp_path / "run"
    VERIFIED.clear()
    code = main(
        [
            "train",
            "--env", f"{__name__}:VowelEnv",
            "--dataset", str(dataset),
            "--model", "tiny",
            "--steps", "2",
            "--prompts", "2",
            "--group-size", "4",
            "--run-dir", str(run_dir),
            "--no-progress",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[0] == f"run dir: {run_dir}"
    assert f"dataset: 8 rows (from {dataset})" in out
    # a user's env gets a real user's defaults, printed first (no toy tuning, no shaping, no warm-up)
    assert "trainer: lr 1e-06 (constant), adam_eps 1e-08" in out and "warm-up 0 step(s); shaping none" in out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # the rewards trained on are the ones our class handed out, through our agent
    assert len(VERIFIED) == sum(r["rollouts_ok"] for r in records) == 16
    # on-policy: step 1's 8 rollouts are verified before step 2's start
    assert [r["env_reward_mean"] for r in records] == pytest.approx(
        [sum(VERIFIED[:8]) / 8, sum(VERIFIED[8:]) / 8]
    )
    # the run directory refers to the user's rows (no copy), and holds charts and viewer
    ref = json.loads((run_dir / "dataset.ref.json").read_text())
    assert ref["path"] == str(dataset.resolve()) and ref["rows"] == 8
    assert not (run_dir / "dataset.jsonl").exists()
    assert (run_dir / "viewer" / "index.html").is_file() and any((run_dir / "charts").glob("*.png"))
    cfg = RunConfig.model_validate(__import__("yaml").safe_load((run_dir / "config.yaml").read_text()))
    assert cfg.env.name == f"{__name__}:VowelEnv" and cfg.data.path == str(dataset)
    assert (cfg.trainer.lr, cfg.warmup.steps, cfg.shaping.kind) == (1e-6, 0, "none")


def test_a_user_env_without_a_dataset_is_an_error_naming_the_fix(tmp_path: Path) -> None:
    cfg = load_run_config([], [], {"env": f"{__name__}:VowelEnv", "run_dir": str(tmp_path / "r")})
    with pytest.raises(ConfigError, match=r"give data\.path"):
        quiet_train(cfg)


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        (f"{__name__}:NotAServer", "not a ResourcesServer subclass"),
        (f"{__name__}:Missing", "not found"),
        ("no_such_module_here:Env", "cannot import 'no_such_module_here'"),
    ],
)
def test_a_bad_class_reference_names_it(ref: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_env(ref)


def test_a_bad_dataset_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    good = orjson.dumps(rows(1)[0]).decode()
    path.write_text(
        "\n".join(
            [
                good,
                "{not json",
                "[1, 2]",
                '{"prompt": "no responses_create_params"}',
                '{"responses_create_params": {"input": "hi", "temperature": "hot"}}',
                "",
                good,
            ]
        )
    )
    with pytest.raises(ConfigError) as err:
        read_dataset(path)
    problems = err.value.problems
    assert [p.split(": ")[0] for p in problems] == [f"{path}:{n}" for n in (2, 3, 4, 5)]
    assert "temperature" in problems[3]
    assert (
        read_dataset(write_rows(tmp_path / "ok.jsonl", rows(3)))
        and len(read_dataset(tmp_path / "ok.jsonl")) == 3
    )
    with pytest.raises(ConfigError, match="no rows"):
        read_dataset(write_rows(tmp_path / "empty.jsonl", []))


def test_agent_url_needs_a_dataset_and_the_gym_path(tmp_path: Path) -> None:
    flags = {"agent_url": "http://127.0.0.1:9", "native": True, "run_dir": str(tmp_path / "r")}
    with pytest.raises(ConfigError) as err:
        load_run_config([], [], flags)
    joined = "\n".join(err.value.problems)
    assert "data.path" in joined and "native" in joined


def test_backend_vllm_without_vllm_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else object())
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    overrides = ["generator.placement=process", f"model.name={model_dir}", "model.backend=vllm"]
    cfg = load_run_config(["smoke"], overrides, {"run_dir": str(tmp_path / "r")})
    with pytest.raises(ConfigError, match=r"gymbridge\[vllm\]"):
        quiet_train(cfg)
    with pytest.raises(ConfigError, match=r"model\.name=PATH"):
        load_run_config(["smoke"], ["model.backend=vllm", "generator.placement=process"])


def test_a_model_that_is_neither_tiny_nor_a_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.name: .*neither"):
        load_run_config(["smoke"], [f"model.name={tmp_path / 'nope'}"])


def test_model_path_trains_like_the_same_weights_in_memory(tmp_path: Path) -> None:
    """``--model PATH``: the tiny VLM saved to a directory trains step for step like ``--model tiny``."""
    from gymbridge.models.tiny_vlm import build_tiny_vlm

    tiny = build_tiny_vlm(0)
    model_dir = tmp_path / "model"
    tiny.model.save_pretrained(model_dir)
    tiny.tokenizer.save_pretrained(model_dir)
    tiny.processor.image_processor.save_pretrained(model_dir)
    records = []
    for name, model in (("tiny", "tiny"), ("path", str(model_dir))):
        flags = {"model": model, "native": True, "steps": 1, "prompts_per_step": 1, "group_size": 4}
        flags["run_dir"] = str(tmp_path / name)
        sets = ["warmup.steps=0", "shaping.kind=token_rate", "rollout.max_tokens=16"]
        result, text = quiet_train(load_run_config(["smoke"], sets, flags))
        records.append(result.records[0])
        if name == "path":
            assert f"model: {model_dir} (local directory)" in text
    assert records[0]["skipped"] is None  # a step that trained
    for key in ("env_reward_mean", "loss", "num_tokens", "grad_norm"):
        assert records[1][key] == pytest.approx(records[0][key], rel=1e-5, abs=1e-7), key


def test_regression_resume_does_not_interpolate_the_saved_config_again(tmp_path: Path) -> None:
    """A resolved config holding a literal ``${`` (``\\${`` on the command line) resumes as saved."""
    from gymbridge.run.config import saved_run_config
    from gymbridge.run.rundir import RunDir

    cfg = load_run_config(["smoke"], [r"env.params.note=\${not_a_key}"])
    assert cfg.env.params["note"] == "${not_a_key}"
    run = RunDir.create(tmp_path)
    run.write_config(cfg.model_dump(mode="json"))
    assert saved_run_config(run.read_config(), where="x").env.params["note"] == "${not_a_key}"
