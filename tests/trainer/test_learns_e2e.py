"""End to end: a real environment, the native bridge, one model shared by generator and trainer.

Two of four rollouts are forced to circle_click's oracle tool call (reward 1), two sample
freely (reward 0). GRPO steps on that group must make the oracle call more likely under the
very prompt the environment gave, with the generator's own logprobs as the old policy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gymbridge.bridge import BridgeConfig, BridgeIterator, NativeRollouts
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.scripted import ScriptedGenerator
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.server import start_server
from gymbridge.tensors import MediaProcessor
from gymbridge.trainer import GRPOConfig, GRPOTrainer, tiny_policy, token_logprobs

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _oracle_tokens(gen: HFGenerator, row: dict[str, Any]) -> list[int]:
    target = next(c for c in row["circles"] if c["color"] == row["target_color"])
    call = {"name": "click", "arguments": {"x": int(target["x"]), "y": int(target["y"])}}
    ids = gen.tokenizer("<tool_call>\n" + json.dumps(call) + "\n</tool_call>", add_special_tokens=False)
    return [int(t) for t in ids["input_ids"]] + [gen.codec.end_of_turn_id]


async def test_grpo_raises_the_rewarded_tool_call_through_the_whole_native_path() -> None:
    from gymbridge_envs import get_env

    spec = get_env("circle_click")
    row = spec.make_row(5, 0, img_size=112, radius_min=8, radius_max=14)
    row["responses_create_params"] = {**row["responses_create_params"], "max_output_tokens": 8}
    tiny = build_tiny_vlm(0)
    policy = tiny_policy(0)
    gen = HFGenerator(policy, tiny.processor)
    oracle = _oracle_tokens(gen, row)
    scripted = ScriptedGenerator(gen, [oracle, None, oracle, None])
    async with await start_server(spec.make_server()) as env:
        source = NativeRollouts(scripted, env.url, max_turns=1)
        try:
            it = BridgeIterator(
                [row],
                source,
                MediaProcessor(tiny.processor),
                BridgeConfig(
                    group_size=4, prompts_per_step=1, min_group_size=None, max_consecutive_failed_groups=8
                ),
            )
            (batch,) = [b async for b in it]
        finally:
            await source.aclose()
    assert sorted(batch.rewards.tolist()) == [0.0, 0.0, 1.0, 1.0]
    winners = batch.advantages > 0
    assert int(winners.sum()) == 2
    rows = (winners[:, None] & (batch.loss_mask > 0)).float()

    def oracle_logprob() -> float:
        with torch.no_grad():
            return float((token_logprobs(policy, batch) * rows).sum() / rows.sum())

    # four epochs on one batch: off-policy after the first, on purpose
    trainer = GRPOTrainer(policy, GRPOConfig(lr=2e-3, clip_eps_high=10.0), on_policy=False)
    before = oracle_logprob()
    first = trainer.step(batch)
    for _ in range(3):
        trainer.step(batch)
    after = oracle_logprob()
    assert first.mean_ratio == pytest.approx(1.0, abs=1e-4)  # generator logprobs = trainer's
    assert first.mean_reward == pytest.approx(0.5)
    assert after > before + 0.5, (before, after)
