"""Trainer step with and without ``trainer.sequence_packing`` on the tiny Qwen2-VL (CPU, fp32).

16 rows (2 prompts x 8 completions, one 56 px image per prompt) whose completions have long-tailed
lengths (4 to 400 tokens, Pareto), the shape a GRPO batch has when a few rollouts run long. For two
token budgets, padded and packed ``compute_gradients`` run alternately (median of 5 each, same
process), and the table shows micro-batches, tokens the forward passes computed, the padding
fraction, the time per step, and the largest gradient difference between the two.

    .venv/bin/python benchmarks/packing_bench.py
"""

from __future__ import annotations

import io
import random
import statistics
import time
from dataclasses import replace

import torch
from PIL import Image

from gymbridge.media import MediaItem
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.tensors import MediaProcessor, TrainBatch
from gymbridge.trainer import GRPOConfig, GRPOTrainer, tiny_policy, token_logprobs
from gymbridge.trajectory.types import Trajectory, Turn


def _image(color: tuple[int, int, int]) -> MediaItem:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), color).save(buf, format="PNG")
    return MediaItem.from_bytes(buf.getvalue(), "image", mime="image/png")


def build_batch(groups: int = 2, group_size: int = 8, seed: int = 0) -> TrainBatch:
    tiny = build_tiny_vlm(0)
    rng = random.Random(seed)
    trajs = []
    for g in range(groups):
        img = _image((60 * g + 20, 90, 200))
        for r in range(group_size):
            n = min(4 + int(rng.paretovariate(0.9) * 6), 400)
            prompt = [tiny.im_start_token_id, 40, 41, tiny.vision_start_token_id, *[tiny.image_token_id] * 4]
            prompt += [tiny.vision_end_token_id, 44, 45]
            gen = [60 + (i * 7 + r) % 40 for i in range(n - 1)] + [tiny.eos_token_id]
            turn = Turn(0, 1, "message", 0, prompt, gen, [0.0] * n, media=[img])
            trajs.append(Trajectory(turns=[turn], reward=float(r % 2), task_index=g, rollout_index=r))
    return TrainBatch.from_trajectories(trajs, MediaProcessor(tiny.processor), group_size=group_size)


def main() -> None:
    torch.set_num_threads(1)
    model = tiny_policy(0)
    batch = build_batch()
    with torch.no_grad():
        lp = token_logprobs(model, batch)
    batch = replace(batch, logprobs=lp * batch.loss_mask)
    print(f"rows {len(batch)}, lengths {sorted(batch.lengths.tolist())}, real tokens {batch.num_tokens}")
    header = (
        f"{'budget':>6} {'mode':>7} {'micro':>5} {'run tok':>8} {'padding':>8} {'ms/step':>8} {'speed-up':>8}"
    )
    print(header + f" {'max |dgrad|':>11}")
    for budget in (512, 2048):
        trainers = {
            packed: GRPOTrainer(model, GRPOConfig(micro_batch_max_tokens=budget, sequence_packing=packed))
            for packed in (False, True)
        }
        times: dict[bool, list[float]] = {False: [], True: []}
        results = {}
        for _ in range(5):
            for packed, trainer in trainers.items():
                t = time.perf_counter()
                results[packed] = trainer.compute_gradients(batch)
                times[packed].append(time.perf_counter() - t)
        diff = max(
            float((a - b).abs().max()) for a, b in zip(results[False].grads, results[True].grads, strict=True)
        )
        base = statistics.median(times[False])
        for packed in (False, True):
            res, ms = results[packed], statistics.median(times[packed]) * 1e3
            micro = len(batch.micro_batches(budget, packed=packed))
            line = f"{budget:>6} {'packed' if packed else 'padded':>7} {micro:>5} {res.tokens_run:>8} "
            line += f"{res.padding_tokens / max(res.tokens_run, 1):>8.3f} {ms:>8.1f} {base * 1e3 / ms:>7.2f}x"
            print(line + (f" {diff:>11.2e}" if packed else ""))


if __name__ == "__main__":
    main()
