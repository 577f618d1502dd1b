"""Driver host memory during an fsdp run checkpoint: the workers' sharded save vs the old gather + one file.

Usage: RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/fsdp_checkpoint_memory.py [VOCAB]
A tiny Qwen2-VL whose vocabulary is VOCAB (default 200000) so embeddings dominate; 2 FSDP workers.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from gymbridge.trainer import GRPOTrainer, init_ray, tiny_policy
from gymbridge.trainer.checkpoint import save_checkpoint, save_sharded_checkpoint
from gymbridge.trainer.grpo import GRPOConfig
from gymbridge.trainer.models import from_config
from gymbridge.trainer.ray_dp import RayDPTrainer


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Peak:
    def __enter__(self) -> Peak:
        self.start = rss_mb()
        self.peak = self.start
        self._stop = False
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, rss_mb())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, rss_mb())
        self.end = rss_mb()


def main() -> None:
    vocab = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    base = tiny_policy(0)
    cfg = copy.deepcopy(base.config)
    cfg.text_config.vocab_size = vocab
    model = from_config(type(base), cfg)
    trainer = GRPOTrainer(model, GRPOConfig())
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    init_ray(2)
    dp = RayDPTrainer(
        trainer, functools.partial(from_config, type(model), cfg), 2, worker_num_cpus=0, strategy="fsdp"
    )
    with tempfile.TemporaryDirectory() as tmp:
        kw = {"step": 1, "policy_version": 1, "trainer": trainer, "done_task_indices": []}
        with Peak() as sharded:
            save_sharded_checkpoint(Path(tmp) / "a", write_shards=dp.save_sharded_checkpoint, **kw)
        assert not trainer.optimizer.state
        with Peak() as gathered:
            dp.pull_optimizer_state()
            save_checkpoint(Path(tmp) / "b", **kw)
        on_disk = sum(f.stat().st_size for f in (Path(tmp) / "a" / "step-000001").iterdir()) / 2**20
    dp.shutdown()
    print(f"policy weights (fp32): {weights_mb:.1f} MiB; sharded checkpoint on disk {on_disk:.1f} MiB")
    print("| path | driver RSS before (MiB) | peak (MiB) | peak - before (MiB) |")
    print("|---|---|---|---|")
    rows = (("fsdp workers write their shards (new)", sharded), ("gather + one file (old)", gathered))
    for name, p in rows:
        print(f"| {name} | {p.start:.0f} | {p.peak:.0f} | {p.peak - p.start:.0f} |")


if __name__ == "__main__":
    main()
