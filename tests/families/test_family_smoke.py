"""``gymbridge smoke run --model tiny:FAMILY`` trains every tiny family; ``model serve`` takes the same spec.

The smoke runs the Gym path (environment, agent and model server on loopback) for 2 steps without
the format warm-up and with the toy token-rate shaping on (16 tokens of the random model's answers:
its groups get reward variance, so a step has a gradient whatever the model answers; a step whose
groups all tie is skipped, as the run does). What a user would notice: every rollout ok, nonzero
gradients, the on-policy ratio at 1 (generator and trainer agree through the family's model
server), and ``encoder_dedup`` true (the family's encoder hook ran once per image).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gymbridge.cli import main
from gymbridge.errors import ConfigError
from gymbridge.models.tiny_families import TINY_FAMILIES, parse_tiny_spec

pytestmark = pytest.mark.integration

_MODEL_NAMES = {"qwen2_5_omni": "gymbridge-tiny-qwen2.5-omni-seed0"}
"""The tiny Omni thinker keeps the name it had as ``tiny-qwen2.5-omni`` (the same model)."""


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_smoke_run_trains_each_tiny_family(
    family: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    argv = ["smoke", "run", "--model", f"tiny:{family}", "--steps", "2", "--group-size", "4", "--no-progress"]
    argv += ["--run-dir", str(run), "--set", "warmup.steps=0", "--set", "rollout.max_tokens=16"]
    argv += ["--set", "shaping.kind=token_rate"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    name = _MODEL_NAMES.get(family, f"gymbridge-tiny-{family.replace('_', '-')}-seed0")
    assert f"model: {name} (random weights, offline)" in out
    assert re.search(
        r"done: 2 step\(s\)( \(1 skipped: no learning signal\))?, 16 rollouts ok, 0 failed", out
    ), out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rollouts_failed"] == 0 and r["rollouts_ok"] == 8
        assert r["encoder_dedup"] is True and r["encoder_segments"] < r["encoder_refs"]
    # a step whose groups all have one reward has no advantage and is skipped (no update); the
    # others train, through the family's model server with the trainer's logprobs equal to its own
    trained = [r for r in records if r["skipped"] is None]
    assert trained, out
    assert all(r["skipped"] == "zero_advantage" for r in records if r not in trained)
    for r in trained:
        assert r["grad_norm"] > 0
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-4)


def test_tiny_specs_parse_and_an_unknown_family_is_refused() -> None:
    assert parse_tiny_spec("tiny:qwen2.5-vl") == parse_tiny_spec("tiny:Qwen2_5_VL") == "qwen2_5_vl"
    assert parse_tiny_spec("tiny") is None and parse_tiny_spec("/models/gemma") is None
    with pytest.raises(ConfigError, match=r"no tiny family 'llama'.*tiny:gemma3"):
        parse_tiny_spec("tiny:llama")


def test_run_config_takes_tiny_families_and_the_older_names_as_aliases() -> None:
    from gymbridge.run.config import load_run_config
    from gymbridge.run.model import tiny_family_of

    cfg = load_run_config(["smoke"], ["model.name=tiny:gemma3"])
    assert cfg.model.name == "tiny:gemma3" and cfg.model.is_tiny
    assert tiny_family_of("tiny-qwen2-vl") == tiny_family_of("tiny:qwen2_vl") == "qwen2_vl"
    assert tiny_family_of("tiny-qwen2.5-omni") == tiny_family_of("tiny:qwen2.5-omni") == "qwen2_5_omni"
    assert tiny_family_of("tiny", ("image",)) == "qwen2_vl"
    assert tiny_family_of("tiny", ("image", "audio")) == "qwen2_5_omni"
    with pytest.raises(ConfigError, match=r"model.name: .*no tiny family 'llama'.*tiny:internvl"):
        load_run_config(["smoke"], ["model.name=tiny:llama"])
    with pytest.raises(ConfigError, match=r"neither a tiny model \(.*tiny:gemma3.*\) nor a model directory"):
        load_run_config(["smoke"], ["model.name=gemma3"])
    with pytest.raises(ConfigError, match="tiny models"):
        load_run_config(["smoke"], ["model.name=tiny:gemma3", "model.backend=vllm"])


def test_tiny_qwen2_vl_family_is_the_default_tiny_model() -> None:
    """``tiny:qwen2_vl`` and ``tiny-qwen2-vl`` are the model ``tiny`` picks for an image environment."""
    from gymbridge.run.model import pick_model

    default, family, alias = (
        pick_model(n, 0, ("image",)) for n in ("tiny", "tiny:qwen2_vl", "tiny-qwen2-vl")
    )
    assert default.name == family.name == alias.name == "gymbridge-tiny-qwen2-vl-seed0"
    assert default.serve_flag == family.serve_flag == "--tiny"
    gemma = pick_model("tiny:gemma3", 0, ("image",))
    assert gemma.name == "gymbridge-tiny-gemma3-seed0" and gemma.serve_flag == ("--model", "tiny:gemma3")
    assert type(gemma.policy).__name__ == "Gemma3ForConditionalGeneration"


def test_smoke_refuses_an_unknown_tiny_family_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["smoke", "run", "--model", "tiny:llama", "--steps", "1", "--run-dir", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no tiny family 'llama'" in err and not (tmp_path / "r").exists()


def test_model_serve_takes_a_tiny_family_and_answers_with_its_image_expansion(tmp_path: Path) -> None:
    """``gymbridge model serve --model tiny:gemma3`` (the ``placement: process`` command line): the
    prompt it reports holds Gemma 3's image block, four soft tokens between its boundaries."""
    import httpx
    from family_helpers import png

    from gymbridge.media import encode_data_url
    from gymbridge.models.tiny_families import tiny_model
    from gymbridge.run.generator_process import start_model_server_process, tiny_server_command

    command = tiny_server_command(
        seed=0,
        max_model_len=512,
        default_max_tokens=4,
        prompt_seed=None,
        enable_weight_updates=False,
        model_flag=("--model", "tiny:gemma3"),
    )
    child = start_model_server_process(command, log_path=tmp_path / "model.log", startup_timeout_s=240)
    try:
        image = {
            "type": "image_url",
            "image_url": {"url": encode_data_url(png((9, 200, 9), (56, 56)), "image/png")},
        }
        body = {
            "model": "any",
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "Which colour?"}]}],
            "max_tokens": 3,
        }
        answer = httpx.post(f"{child.url}/v1/chat/completions", json=body, timeout=60).json()
        models = httpx.get(f"{child.url}/v1/models", timeout=10).json()
    finally:
        child.stop()
    assert [m["id"] for m in models["data"]] == ["gymbridge-tiny-gemma3-seed0"]
    tok = tiny_model("gemma3").tokenizer
    ids = answer["prompt_token_ids"]
    boi, soft, eoi = (
        tok.convert_tokens_to_ids(t) for t in ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
    )
    start = ids.index(boi)
    assert ids[start + 1 : start + 6] == [soft] * 4 + [eoi] and ids.count(soft) == 4
    assert len(answer["choices"][0]["token_ids"]) <= 3


def test_model_serve_refuses_a_tiny_family_on_vllm() -> None:
    import argparse

    from gymbridge.generation.cli import build_generator

    args = argparse.Namespace(
        tiny=False, tiny_omni=False, model="tiny:internvl", backend="vllm", no_reasoning_parser=False, seed=0
    )
    with pytest.raises(ConfigError, match="--model tiny:internvl is the transformers model"):
        build_generator(args)
