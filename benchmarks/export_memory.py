"""Peak memory of ``gymbridge export`` (streamed) against loading the model whole and ``save_pretrained``.

A random Qwen2-VL of ~200M parameters (789 MiB fp32) is written as a run checkpoint with one AdamW
moment per weight (~1.6 GiB), then exported twice, each in a fresh process: ``export_hf`` with
100 MB shards, and ``load_state`` + ``save_pretrained``. Prints the growth of the peak resident and
of the anonymous (private) memory over the start. Run::

    .venv/bin/python benchmarks/export_memory.py            # all three steps in a scratch folder
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

CONFIG = Qwen2VLConfig(
    text_config={
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 10000.0},
    },
    vision_config={"depth": 4, "embed_dim": 512, "hidden_size": 1024, "num_heads": 8},
    tie_word_embeddings=False,
)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


def make(root: Path) -> None:
    from gymbridge.safe_io import save_state

    sd = Qwen2VLForConditionalGeneration(CONFIG).state_dict()
    n = sum(v.numel() for v in sd.values())
    ckpt = root / "run" / "checkpoints"
    ckpt.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v for k, v in sd.items()} | {
        f"optim.{i}.exp_avg": v.clone() for i, v in enumerate(sd.values())
    }
    save_state(ckpt / "step-000001.ckpt", tensors, {"format": "gymbridge-run-checkpoint/1", "step": 1})
    latest = {"format": "gymbridge-run-checkpoint/1", "step": 1, "state": "step-000001.ckpt"}
    (ckpt / "latest.json").write_text(json.dumps(latest))
    size = (ckpt / "step-000001.ckpt").stat().st_size / 2**20
    print(f"params {n / 1e6:.0f}M, model {n * 4 / 2**20:.0f} MiB, checkpoint {size:.0f} MiB")


def export(root: Path, mode: str) -> None:
    peak = [0.0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], _anon_mib())
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    out = root / f"out-{mode}"
    base, anon0, started = _rss_mib(), _anon_mib(), time.perf_counter()
    if mode == "stream":
        from gymbridge.trainer.export import ModelParts, export_hf

        parts = ModelParts(Qwen2VLForConditionalGeneration, CONFIG, None, None)
        export_hf(root / "run", out, parts=parts, max_shard_size="100MB")
    else:
        from gymbridge.safe_io import load_state

        tensors, _ = load_state(root / "run" / "checkpoints" / "step-000001.ckpt")
        with torch.device("meta"):
            model = Qwen2VLForConditionalGeneration(CONFIG)
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, assign=True)
        del tensors
        model.save_pretrained(out, max_shard_size="100MB")
    print(
        f"{mode:>6}: peak RSS above start {_rss_mib() - base:.0f} MiB "
        f"(anonymous: {peak[0] - anon0:.0f} MiB), {time.perf_counter() - started:.1f}s"
    )


def main() -> None:
    if len(sys.argv) == 3:
        root, mode = Path(sys.argv[1]), sys.argv[2]
        make(root) if mode == "make" else export(root, mode)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("make", "stream", "whole"):  # a fresh process each: peaks do not carry over
            subprocess.run([sys.executable, __file__, tmp, mode], check=True)


if __name__ == "__main__":
    main()
