"""The run's generator samples from the distribution the trainer scores, for every sampling setting
the trainer reads (``trainer.temperature``, ``trainer.top_p``, ``trainer.suppress_token_ids``).

Regression: ``trainer.suppress_token_ids`` reached the trainer's scorer only; the generator (in
process, or ``gymbridge model serve`` in its own process) never masked those ids. On-policy the drift
guard failed; off-policy (``bridge.max_staleness > 0``, guard off) the importance ratios were biased.
Each test compares the generator's logprobs with the trainer's teacher-forced ones on the same tokens
(the drift guard's comparison) on the tiny model.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from run_helpers import quiet_train, run_config

from gymbridge.errors import ConfigError
from gymbridge.generation.types import media_special_token_ids
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.run.placement import GeneratorConfig, start_generator
from gymbridge.tensors import MediaProcessor, TrainBatch
from gymbridge.trainer import GRPOConfig, tiny_policy, token_logprobs
from gymbridge.trajectory.types import Trajectory, Turn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

EXTRA = tuple(range(100, 300))
"""Ids the trainer masks on top of the media ids: 200 of the tiny tokenizer's 512 (bytes and merges),
so an unmasked sampler draws them often and renormalises over them."""
SAMPLING: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9}


def _trainer(model_config: Any) -> GRPOConfig:
    return GRPOConfig(suppress_token_ids=(*media_special_token_ids(model_config), *EXTRA), **SAMPLING)


def _trainer_logprobs(prompt: list[int], generated: list[int], trainer: GRPOConfig) -> list[float]:
    """The trainer's scorer on ``prompt + generated`` (``[T]`` logprobs of the generated tokens)."""
    tiny = build_tiny_vlm(0)
    turn = Turn(
        index=0,
        item_index=0,
        kind="message",
        segment=0,
        prompt_token_ids=prompt,
        generation_token_ids=generated,
        generation_logprobs=[0.0] * len(generated),
        media=[],
    )
    batch = TrainBatch.from_trajectories(
        [Trajectory(turns=[turn], reward=0.0, task_index=0, rollout_index=0)],
        MediaProcessor(tiny.processor),
        group_size=1,
    )
    with torch.no_grad():
        lp = token_logprobs(
            tiny_policy(0),
            batch,
            temperature=trainer.temperature,
            suppress_token_ids=trainer.suppress_token_ids,
            top_p=trainer.top_p,
        )
    return [float(x) for x in lp[0, len(prompt) : len(prompt) + len(generated)]]


@pytest.mark.parametrize("placement", ["in_process", "process"])
async def test_regression_the_generator_masks_what_the_trainer_masks(placement: str, tmp_path: Path) -> None:
    tiny = build_tiny_vlm(0)
    trainer = _trainer(tiny.model.config)
    async with contextlib.AsyncExitStack() as stack:
        handle = await start_generator(
            GeneratorConfig(placement=placement),  # type: ignore[arg-type]
            stack,
            serve=True,
            model_seed=0,
            processor=tiny.processor,
            max_model_len=512,
            default_max_tokens=24,
            prompt_seed=None,
            model_name="tiny",
            log_dir=tmp_path,
            suppress_token_ids=EXTRA,
        )
        body = {"input": [{"role": "user", "content": "name a colour"}], "seed": 3, **SAMPLING}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{handle.model_url}/v1/responses", json=body) as r,
        ):
            assert r.status == 200, await r.text()
            last = (await r.json())["output"][-1]
    generated, logprobs = last["generation_token_ids"], last["generation_log_probs"]
    assert len(generated) > 3 and not set(generated) & set(EXTRA)
    scored = _trainer_logprobs(last["prompt_token_ids"], generated, trainer)
    assert max(abs(a - b) for a, b in zip(logprobs, scored, strict=True)) < 1e-4, (logprobs, scored)


@pytest.mark.parametrize(
    "where",
    [{"rollout.native": True}, {"generator.placement": "process"}],
    ids=["native_in_process", "gym_process"],
)
def test_regression_a_run_samples_what_its_trainer_scores(where: dict[str, Any], tmp_path: Path) -> None:
    """Every sampling key the trainer reads, set at once: the run's drift guard sees ratio 1."""
    trainer = _trainer(build_tiny_vlm(0).model.config)
    settings = {
        **where,
        "steps": 1,
        "bridge.prompts_per_step": 1,
        "bridge.group_size": 4,
        "rollout.max_tokens": 16,
        "warmup.steps": 0,
        "shaping.kind": "token_rate",  # reward variance: the step trains, so the guard compares
        "trainer.temperature": trainer.temperature,
        "trainer.top_p": trainer.top_p,
        "trainer.suppress_token_ids": list(trainer.suppress_token_ids or ()),
    }
    summary, _ = quiet_train(run_config(tmp_path / "run", settings))
    step = summary.steps[0]
    assert step.skipped is None and step.num_loss_tokens > 0
    assert step.ratio_max_abs_log < 1e-4, step


def test_regression_a_mask_without_the_media_ids_is_refused(tmp_path: Path) -> None:
    """Every generator masks the media ids; a trainer mask without them scores another distribution."""
    cfg = run_config(tmp_path / "run", {"steps": 1, "warmup.steps": 0, "trainer.suppress_token_ids": [100]})
    with pytest.raises(ConfigError, match=r"leaves out the model's media ids \[3, 4, 5, 6\]"):
        quiet_train(cfg)
