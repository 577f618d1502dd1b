"""Time per weight sync: trainer -> model server in another process, and in-process copy.

For each model size (the tiny smoke model and a random Qwen2-VL of about 100 M parameters,
built from the same seed on both sides), a child process serves the model with
``ModelServer(..., weight_sink=WeightReceiver(...))`` (the routes ``gymbridge model serve
--enable-weight-updates`` opens) and the parent publishes ``--syncs`` versions with
``DistributedPublisher`` over gloo (CPU), plus the same number of in-process copies with
``InProcessPublisher``. Each sync is timed end to end (HTTP control, bucketed broadcasts, the
receiver's copy under its lock, the loaded mark). Not part of the test suite.

    .venv/bin/python benchmarks/weight_sync_bench.py [--syncs 5] [--bucket-mb 64] [--sizes tiny,100m]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import signal
import statistics
import subprocess
import sys
from typing import Any

import torch


def build(size: str) -> Any:
    """The model of ``size`` (``tiny`` or ``100m``), seed 0, fp32."""
    from gymbridge.testing.tiny_vlm import build_tiny_vlm

    tiny = build_tiny_vlm(0)
    if size == "tiny":
        return copy.deepcopy(tiny.model)
    from transformers import Qwen2VLForConditionalGeneration

    config = copy.deepcopy(tiny.model.config)
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = 768, 3072, 12
    text.num_attention_heads, text.num_key_value_heads = 12, 4
    text.head_dim = 64
    text.layer_types = ["full_attention"] * text.num_hidden_layers
    rope = dict(text.rope_parameters)
    rope["mrope_section"] = [16, 8, 8]
    text.rope_parameters = rope
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        return Qwen2VLForConditionalGeneration(config).eval()
    finally:
        torch.random.set_rng_state(state)


async def serve(size: str) -> None:
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.generation.server import ModelServer, ModelServerConfig
    from gymbridge.generation.weights import WeightReceiver
    from gymbridge.testing.tiny_vlm import build_tiny_vlm

    gen = HFGenerator(build(size), build_tiny_vlm(0).processor, max_model_len=256)
    server = ModelServer(gen, config=ModelServerConfig(batching=False), weight_sink=WeightReceiver(gen))
    url = await server.start()
    print(f"serving on {url}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop()


def measure(size: str, syncs: int, bucket_mb: int) -> dict[str, Any]:
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.generation.weights import named_weights, plan_buckets
    from gymbridge.testing.tiny_vlm import build_tiny_vlm
    from gymbridge.trainer.weight_sync import DistributedPublisher, InProcessPublisher

    model = build(size)
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(t.numel() * t.element_size() for _, t in named_weights(model))
    buckets = len(plan_buckets(named_weights(model), bucket_mb * 1024 * 1024))
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", size], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[-1]
        publisher = DistributedPublisher(url, bucket_bytes=bucket_mb * 1024 * 1024)
        times = []
        for v in range(syncs + 1):  # version 0 also sets up the group: reported apart
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)
            times.append(publisher.publish(model, v))
        publisher.close()
    finally:
        proc.terminate()
        proc.wait(30)
    local = HFGenerator(build(size), build_tiny_vlm(0).processor)
    in_process = InProcessPublisher(local)
    copies = [in_process.publish(model, v) for v in range(1, syncs + 1)]
    return {
        "size": size,
        "params": params,
        "mib": nbytes / 2**20,
        "buckets": buckets,
        "first_s": times[0],
        "sync_s": statistics.median(times[1:]),
        "sync_max_s": max(times[1:]),
        "copy_s": statistics.median(copies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--sizes", default="tiny,100m")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    torch.set_num_threads(1)
    rows = [measure(size, args.syncs, args.bucket_mb) for size in args.sizes.split(",")]
    print(
        f"{'model':>6} {'params':>12} {'MiB':>8} {'buckets':>8} {'v0+join s':>10} "
        f"{'sync s (median)':>16} {'max s':>8} {'in-proc copy s':>15}"
    )
    for r in rows:
        print(
            f"{r['size']:>6} {r['params']:>12,} {r['mib']:>8.1f} {r['buckets']:>8} {r['first_s']:>10.3f} "
            f"{r['sync_s']:>16.3f} {r['sync_max_s']:>8.3f} {r['copy_s']:>15.4f}"
        )
    print(f"\n{args.syncs} syncs per size after version 0; gloo, loopback, fp32, bucket {args.bucket_mb} MiB")


if __name__ == "__main__":
    main()
