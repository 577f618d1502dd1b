"""``GRPORun.step()`` without servers: an in-process environment, the real generator and trainer.

The environment answers ``/seed_session`` and ``/verify`` through an ``httpx.MockTransport``; the
rollouts are gymbridge's native loop over the tiny Qwen2-VL's own generator copy, so the trainer's
logprobs are the sampler's (ratio 1). What a step reports, when it skips, what it publishes, and
the callbacks fed a recorded :class:`~gymbridge.run.StepReport`.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from gymbridge.bridge import BridgeConfig, BridgeIterator, NativeRollouts
from gymbridge.generation.hf import HFGenerator
from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.run import ConsoleCallback, GRPORun, MetricsFileCallback, RunConfig, RunDir, StepReport
from gymbridge.run.callbacks import step_line
from gymbridge.run.model import RunModel
from gymbridge.tensors import MediaProcessor
from gymbridge.trainer import GRPOTrainer, InProcessPublisher, tiny_policy

Reward = Callable[[str], float]


def _parity(text: str) -> float:
    """A reward that varies between rollouts of one prompt: the parity of the answer's hash."""
    return float(hashlib.sha256(text.encode()).digest()[0] % 2)


def env_transport(reward: Reward) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path.endswith("/seed_session"):
            return httpx.Response(200, json={})
        text = "".join(
            part.get("text", "")
            for item in body["response"]["output"]
            if item.get("type") == "message"
            for part in item.get("content", [])
        )
        return httpx.Response(200, json={**body, "reward": reward(text)})

    return httpx.MockTransport(handle)


def rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "responses_create_params": {
                "input": f"Say something ({i}).",
                "max_output_tokens": 6,
                "temperature": 1.0,
            }
        }
        for i in range(n)
    ]


class Parts:
    """A run over an in-process environment; ``published`` lists every version handed to the generator."""

    def __init__(self, tiny: TinyVLM, tmp_path: Path, reward: Reward, *, steps: int = 3) -> None:
        self.config = RunConfig.model_validate(
            {
                "steps": steps,
                "env": {"name": "in_process"},
                "trainer": {"lr": 1e-3},
                "output": {"run_dir": str(tmp_path)},
            }
        )
        policy = tiny_policy(0)
        self.generator = HFGenerator(tiny_policy(0), tiny.processor, max_model_len=512)
        source = NativeRollouts(
            self.generator,
            "http://env.test",
            max_turns=1,
            seed=0,
            mode="tools",
            transport=env_transport(reward),
        )
        self.bridge = BridgeIterator(
            rows(steps * 2),
            source,
            MediaProcessor(tiny.processor),
            BridgeConfig(group_size=4, prompts_per_step=2),
            failures_path=tmp_path / "failures.jsonl",
        )
        self.trainer = GRPOTrainer(policy, self.config.trainer)
        self.model = RunModel(
            "tiny", tiny.processor, tiny.tokenizer, policy, (tiny.image_token_id,), tiny_policy, "--tiny"
        )
        self.published: list[int] = []
        self.publisher = InProcessPublisher(self.generator)  # what generator.placement: in_process uses
        self.run_dir = RunDir.create(tmp_path)

    def publish(self, version: int) -> float:
        self.published.append(version)
        return self.publisher.publish(self.trainer.model, version)

    def run(self, callbacks: list[Any]) -> GRPORun:
        return GRPORun.from_parts(
            self.config,
            run_dir=self.run_dir,
            model=self.model,
            trainer=self.trainer,
            bridge=self.bridge,
            publish=self.publish,
            callbacks=callbacks,
        )


def _steps(parts: Parts, callbacks: list[Any], n: int) -> list[StepReport]:
    async def go() -> list[StepReport]:
        run = parts.run(callbacks)
        try:
            out = []
            for _ in range(n):
                report = await run.step()
                assert report is not None
                out.append(report)
            return out
        finally:
            await run.cleanup()

    return asyncio.run(go())


def test_a_step_trains_publishes_and_reports(tiny: TinyVLM, tmp_path: Path) -> None:
    parts = Parts(tiny, tmp_path, _parity)
    out = io.StringIO()
    reports = _steps(parts, [MetricsFileCallback(), ConsoleCallback(out)], 3)
    trained = [r for r in reports if r.skipped is None]
    assert trained, [r.metrics for r in reports]
    assert [r.step for r in reports] == [1, 2, 3]
    assert parts.published == list(range(1, len(trained) + 1))  # one version per optimizer step
    for r in trained:
        assert r.published and r.metrics.ratio_mean == pytest.approx(1.0, abs=1e-4)  # on-policy
        assert r.policy_version == r.metrics.policy_version
        # the publisher's own measure, reported as is and inside the step's weight_sync phase
        assert r.weight_sync_s == r.metrics.weight_sync_s > 0
        assert r.record()["timing/weight_sync"] >= r.weight_sync_s
    # the generator holds the trainer's weights at the last version published
    assert parts.generator.policy_version == reports[-1].policy_version == len(trained)
    generated = parts.generator.model.state_dict()
    assert all(torch.equal(t, generated[k]) for k, t in parts.trainer.model.state_dict().items())
    for r in reports:
        record = r.record()
        assert all(v >= 0 for k, v in record.items() if k.startswith("timing/"))  # ``other``: no overlap
        assert record["timing/forward_backward"] == pytest.approx(r.metrics.forward_backward_s)
        assert record["rollouts_ok"] == 8 and len(record["task_indices"]) == 2
    lines = [json.loads(x) for x in parts.run_dir.metrics_path.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and lines[-1] == reports[-1].record()
    assert out.getvalue().count("step ") == 3 and "step 3/3  env reward" in out.getvalue()


def test_regression_a_zero_advantage_batch_does_not_step_the_optimizer(tiny: TinyVLM, tmp_path: Path) -> None:
    """A batch whose every group had equal rewards stepped AdamW (momentum and weight decay moved the
    weights), bumped the policy version and republished the same weights."""
    parts = Parts(tiny, tmp_path, lambda text: 1.0)
    before = [p.detach().clone() for p in parts.trainer.params]
    reports = _steps(parts, [MetricsFileCallback()], 2)
    assert all(r.skipped == "zero_advantage" and not r.published for r in reports)
    assert [r.policy_version for r in reports] == [0, 0] and parts.published == []
    assert parts.trainer.steps == 0 and not parts.trainer.optimizer.state
    assert all(torch.equal(p, b) for p, b in zip(parts.trainer.params, before, strict=True))
    lines = [json.loads(x) for x in parts.run_dir.metrics_path.read_text().splitlines()]
    assert [x["skipped"] for x in lines] == ["zero_advantage", "zero_advantage"]
    assert all(x["groups_zero_variance"] == 2 and x["published"] is False for x in lines)


def test_the_console_line_of_a_recorded_step_report(tiny: TinyVLM, tmp_path: Path) -> None:
    """Callbacks read the report alone: a recorded report prints the same line again."""
    parts = Parts(tiny, tmp_path, lambda text: 1.0)
    (report,) = _steps(parts, [], 1)
    line = step_line(report, report.record(), parts.config)
    assert line.startswith("step 1/3  env reward 1.000  loss ")
    assert "skipped (zero advantage: no update, v0 kept)" in line and "->" not in line


def test_the_reference_policy_has_one_dtype_on_every_path() -> None:
    """Regression: with ``trainer.dtype=bfloat16`` and ``kl_coef > 0`` the reference was fp32 on a
    fresh run (frozen before the cast) and bf16 on a resumed one (cast first); DP workers held bf16
    while the driver's was fp32. It is the trainer's dtype on every path now."""
    from gymbridge.trainer import GRPOConfig
    from gymbridge.trainer.ray_dp import DPWorker

    cfg = GRPOConfig(kl_coef=0.1, dtype="bfloat16")

    def ref_dtypes(trainer: GRPOTrainer) -> set[torch.dtype]:
        assert trainer.reference is not None
        return {p.dtype for p in trainer.reference.parameters()}

    fresh = GRPOTrainer(tiny_policy(0), cfg)  # a fresh run: the policy is still fp32 (warm-up first)
    fresh.freeze_reference()  # after the warm-up
    resumed = GRPOTrainer(tiny_policy(0).to(torch.bfloat16), cfg)  # a resumed run casts first
    worker = DPWorker(0, 1, lambda: tiny_policy(0), cfg, torch.bfloat16)
    assert ref_dtypes(fresh) == ref_dtypes(resumed) == ref_dtypes(worker.trainer) == {torch.bfloat16}
    assert {p.dtype for p in fresh.model.parameters()} == {torch.float32}  # the policy itself is untouched


def test_a_rollout_sampled_at_another_temperature_is_refused(tiny: TinyVLM) -> None:
    """Regression: only ``top_p`` was checked against the trainer; a row's temperature was not."""
    from gymbridge.errors import SamplingMismatchError
    from gymbridge.trainer.grpo import check_sampling

    class Batch:
        def __init__(self) -> None:
            self.metadata = [
                {"sampling": {"temperature": 0.7, "top_p": 1.0}, "task_index": 3, "rollout_index": 1}
            ]

    with pytest.raises(
        SamplingMismatchError, match=r"temperature=0.7 but the trainer scores with trainer.temperature=1"
    ):
        check_sampling(Batch(), 1.0, 1.0)  # type: ignore[arg-type]
    check_sampling(Batch(), 1.0, 0.7)  # type: ignore[arg-type]
    check_sampling(Batch(), 1.0)  # type: ignore[arg-type]  # temperature not given: not checked
