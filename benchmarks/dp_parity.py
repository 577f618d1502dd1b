"""DP parity: ``dp_workers`` 0, 1, 2 (and 2 with dedup off) on one batch for three fp32 CPU steps.

Prints, per step, the loss and grad norm of the single-process trainer and the largest
difference of each DP run from it, then whether every rank's weights equal the driver's.
The batch is the trainer tests' (2 prompts x 4 rollouts of the tiny Qwen2-VL, two rows per
micro-batch, so every worker accumulates before its all-reduce).

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/dp_parity.py
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "trainer"))

from trainer_helpers import make_batch, with_current_logprobs

from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.trainer import GRPOConfig, GRPOTrainer, RayDPTrainer, from_config, init_ray, tiny_policy

# encoder_dedup off: the bit-identity of dedup on vs off is one of transport (docs/dp.md)
CONFIG = GRPOConfig(lr=1e-3, micro_batch_max_tokens=40, encoder_dedup=False)
STEPS = 3


def fresh() -> GRPOTrainer:
    return GRPOTrainer(tiny_policy(0), CONFIG, on_policy=False)


def main() -> None:
    tiny = build_tiny_vlm(0)
    batch = with_current_logprobs(tiny_policy(0), make_batch(tiny))
    copies = with_current_logprobs(tiny_policy(0), make_batch(tiny, dedup=False))
    ray = init_ray(num_cpus=2)
    model = tiny_policy(0)
    factory = functools.partial(from_config, type(model), model.config)
    started = time.perf_counter()
    dps = {n: RayDPTrainer(fresh(), factory, n, worker_num_cpus=0.5) for n in (1, 2)}
    print(f"3 workers started, groups joined in {time.perf_counter() - started:.1f}s")
    runs: dict[str, list[tuple[float, float]]] = {}
    local = fresh()
    runs["dp0"] = [(m.loss, m.grad_norm) for m in (local.step(batch) for _ in range(STEPS))]
    digests: dict[str, bool] = {}
    for name, n, b in (("dp1", 1, batch), ("dp2", 2, batch), ("dp2 dedup off", 2, copies)):
        dp = dps[n]
        dp.trainer = fresh()
        dp.sync_workers()
        runs[name] = [(m.loss, m.grad_norm) for m in (dp.step(b) for _ in range(STEPS))]
        digests[name] = len(set(dp.param_digests())) == 1
    for dp in dps.values():
        dp.shutdown()
    ray.shutdown()
    print(
        f"\n{'step':>4} {'loss (dp0)':>14} {'grad_norm (dp0)':>16}  "
        + "  ".join(f"{'|d loss| ' + k:>22} {'|d norm| ' + k:>22}" for k in runs if k != "dp0")
    )
    for s in range(STEPS):
        loss, norm = runs["dp0"][s]
        cells = [
            f"{abs(runs[k][s][0] - loss):>22.2e} {abs(runs[k][s][1] - norm):>22.2e}"
            for k in runs
            if k != "dp0"
        ]
        print(f"{s + 1:>4} {loss:>14.8f} {norm:>16.8f}  " + "  ".join(cells))
    same = runs["dp2"] == runs["dp2 dedup off"]
    print(f"\ndedup on vs off (dp2): losses and norms bit-identical: {same}")
    print("every rank's weights == the driver's: " + ", ".join(f"{k} {v}" for k, v in digests.items()))


if __name__ == "__main__":
    main()
