"""Time per weight sync to a model server in another process, beside a bare gloo broadcast.

For each model size (the tiny smoke model and a random Qwen2-VL of about 100 M parameters,
built from the same seed on both sides) this runs, **interleaved round by round** so that load
from other jobs hits every column alike:

* ``bare``: a bare ``torch.distributed`` gloo broadcast of the same bytes, in the same bucket
  sizes, between this process and a peer process, from and into buffers allocated once (no
  packing, no HTTP, no model), ended by a one-element all-reduce as the acknowledgement: the
  floor a socket-based sync is built on;
* ``broadcast``: ``DistributedPublisher(transport="broadcast")`` to a child serving the model
  with ``ModelServer(..., weight_sink=WeightReceiver(...))`` (the routes ``gymbridge model
  serve --enable-weight-updates`` opens): HTTP control, packed bucketed broadcasts, the
  receiver's copy under its lock, the loaded mark;
* ``shared_memory``: ``DistributedPublisher(transport="shared_memory")`` to a second such child:
  one copy into a ``/dev/shm`` segment, the child swaps its weights to it;
* ``in-process``: ``InProcessPublisher`` copying into a generator in this process.

Each sync is timed end to end (until the server has loaded the version). Printed: medians,
and the ratios ``broadcast / bare`` (goal <= 1.5) and ``bare / shared_memory`` (goal >= 3).
Not part of the test suite.

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
import time
from inspect import signature
from typing import Any

import torch


def build(size: str) -> Any:
    """The model of ``size`` (``tiny`` or ``100m``), seed 0, fp32."""
    from gymbridge.models.tiny_vlm import build_tiny_vlm

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
    from gymbridge.models.tiny_vlm import build_tiny_vlm
    from gymbridge.testing.model_server import TESTING_WEIGHTS_SECRET

    torch.set_num_threads(1)
    gen = HFGenerator(build(size), build_tiny_vlm(0).processor, max_model_len=256)
    server = ModelServer(
        gen,
        config=ModelServerConfig(batching=False),
        weight_sink=WeightReceiver(gen),
        weights_secret=TESTING_WEIGHTS_SECRET,
    )
    url = await server.start()
    print(f"serving on {url}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop()


def bare_peer(port: int, sizes: list[int], rounds: int) -> None:
    """Rank 1 of the bare broadcast: receive ``sizes`` bytes per round into one buffer, then ack."""
    from gymbridge.generation.weights import open_weight_group, weight_store

    torch.set_num_threads(1)
    store = weight_store("127.0.0.1", port, world_size=2, is_host=False)
    group = open_weight_group(store, rank=1, world_size=2, backend="gloo")
    buffer = torch.empty(max(sizes), dtype=torch.uint8)
    for _ in range(rounds):
        for n in sizes:
            group.broadcast(buffer[:n])
        _ack(group)
    group.close()


def _ack(group: Any) -> None:
    group._group.allreduce([torch.ones(1)]).wait()


def start_child(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, line.split()[-1] if line else ""


def stop_child(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def measure(size: str, syncs: int, bucket_mb: int) -> dict[str, Any]:
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.generation.weights import named_weights, open_weight_group, plan_buckets, weight_store
    from gymbridge.models.tiny_vlm import build_tiny_vlm
    from gymbridge.trainer.weight_sync import DistributedPublisher, InProcessPublisher

    bucket_bytes = bucket_mb * 1024 * 1024
    model = build(size)
    params = sum(p.numel() for p in model.parameters())
    named = named_weights(model)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    buckets = plan_buckets(named, bucket_bytes)
    sizes = [b.numel * dict(named)[b.specs[0].name].element_size() for b in buckets]
    children: list[subprocess.Popen[Any]] = []
    publishers: list[DistributedPublisher] = []
    # a checkout from before the transports (a "before" run) has the broadcast only
    transports = (
        ["broadcast", "shared_memory"]
        if "transport" in signature(DistributedPublisher).parameters
        else ["broadcast"]
    )
    times: dict[str, list[float]] = {"bare": [], **{t: [] for t in transports}}
    first: dict[str, float] = {}
    try:
        for transport in transports:
            proc, url = start_child(["--serve", size])
            children.append(proc)
            kwargs: dict[str, Any] = {"transport": transport} if len(transports) > 1 else {}
            if "secret" in signature(DistributedPublisher).parameters:
                from gymbridge.testing.model_server import TESTING_WEIGHTS_SECRET

                kwargs["secret"] = TESTING_WEIGHTS_SECRET
            pub = DistributedPublisher(url, bucket_bytes=bucket_bytes, **kwargs)
            publishers.append(pub)
            first[transport] = pub.publish(model, 0)  # version 0 also sets the transport up
            assert getattr(pub, "transport", transport) == transport, (pub, transport)
        store = weight_store("127.0.0.1", 0, world_size=2, is_host=True)
        peer = subprocess.Popen(
            [sys.executable, __file__, "--bare", str(store.port), ",".join(map(str, sizes)), str(syncs + 1)],
            start_new_session=True,
        )
        children.append(peer)
        group = open_weight_group(store, rank=0, world_size=2, backend="gloo")
        source = torch.empty(max(sizes), dtype=torch.uint8).fill_(1)

        def bare() -> float:
            started = time.perf_counter()
            works = [group.broadcast_async(source[:n]) for n in sizes]
            for w in works:
                group.wait(w)
            _ack(group)
            return time.perf_counter() - started

        first["bare"] = bare()
        for v in range(1, syncs + 1):
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)
            times["bare"].append(bare())
            for pub, transport in zip(publishers, transports, strict=True):
                times[transport].append(pub.publish(model, v))
        group.close()
    finally:
        for pub in publishers:
            pub.close()
        for proc in children:
            stop_child(proc)
    local = HFGenerator(build(size), build_tiny_vlm(0).processor)
    in_process = InProcessPublisher(local)
    copies = [in_process.publish(model, v) for v in range(1, syncs + 1)]
    median = {k: statistics.median(v) for k, v in times.items()}
    return {
        "size": size,
        "params": params,
        "mib": nbytes / 2**20,
        "buckets": len(buckets),
        "first": first,
        "median": median,
        "max": {k: max(v) for k, v in times.items()},
        "copy_s": statistics.median(copies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--sizes", default="tiny,100m")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--bare", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    if args.bare:
        port, sizes, rounds = args.bare
        bare_peer(int(port), [int(s) for s in sizes.split(",")], int(rounds))
        return
    torch.set_num_threads(1)
    rows = [measure(size, args.syncs, args.bucket_mb) for size in args.sizes.split(",")]
    print(
        f"{'model':>6} {'MiB':>7} {'buckets':>7} {'bare s':>8} {'broadcast s':>12} {'shm s':>8} "
        f"{'in-proc s':>10} {'broadcast/bare':>15} {'bare/shm':>9}   first (set-up): bare / broadcast / shm"
    )
    for r in rows:
        m, f = r["median"], r["first"]
        shm = m.get("shared_memory", float("nan"))
        print(
            f"{r['size']:>6} {r['mib']:>7.1f} {r['buckets']:>7} {m['bare']:>8.4f} {m['broadcast']:>12.4f} "
            f"{shm:>8.4f} {r['copy_s']:>10.4f} {m['broadcast'] / m['bare']:>14.2f}x "
            f"{m['bare'] / shm:>8.2f}x   {f['bare']:.3f} / {f['broadcast']:.3f} / "
            f"{f.get('shared_memory', float('nan')):.3f} s"
        )
    print(
        f"\nmedians of {args.syncs} interleaved rounds after version 0; gloo over loopback, fp32, "
        f"bucket {args.bucket_mb} MiB; goals: broadcast/bare <= 1.5x, bare/shm >= 3x"
    )


if __name__ == "__main__":
    main()
