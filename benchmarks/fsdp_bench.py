"""``dp.strategy: fsdp`` against one process and against ``replicate``, on gloo CPU ranks.

Three tables from one run (every rank is a ``torch.multiprocessing`` process running the real
:class:`~gymbridge.trainer.ray_dp.FSDPWorker`, without Ray):

* **parity**: one GRPO step (fp32) on 2 FSDP ranks vs ``GRPOTrainer.step`` in one process, per tiny
  family (text-only batches here: the image, video and audio paths are checked in
  ``tests/trainer/test_fsdp.py``): loss difference and the largest parameter difference;
* **resident bytes** per rank (parameters, gradients, AdamW state) for N = 1, 2, 4 ranks, ``replicate``
  (a whole replica: what a ``DPWorker`` holds, measured in one process) vs ``fsdp``, on a random
  Qwen2-VL scaled to tens of millions of parameters;
* **publication** (real Ray actors, one ``RayDPTrainer`` per N, the scaled Qwen2-VL in fp32): the
  whole policy in ``--bucket-mb`` buckets, timed four ways in one group, best of ``--repeats``:
  *gather* (every rank's ``FSDPWorker.gather``: its rows into one flat buffer, one ``gather`` to
  rank 0; slowest rank), *gather + Ray* (``RayDPTrainer._publish_from_shards``: the same, rank 0's
  buffers through Ray to the driver and into its policy), *broadcast* (a raw
  ``torch.distributed.broadcast`` of the same bytes in the same buckets; slowest rank) and
  *broadcast + Ray* (that, with rank 0 returning each bucket's bytes to the driver, which copies
  them). N = 1 has no collective: its ratios only show the packing and Ray costs.

    .venv/bin/python benchmarks/fsdp_bench.py [--ranks 1 2 4] [--families ...] [--bucket-mb 64]
        [--repeats 3] [--only parity bytes publish]

Writes nothing (``--json PATH`` writes the numbers there).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import queue
import socket
import time
from typing import Any

import torch
import torch.multiprocessing as mp

TEXT_ROWS = 8
"""Rows of each benchmark batch (2 groups of 4), text only."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def text_batch(processor: Any, eos: int, *, prompt_len: int = 12, seed: int = 0) -> Any:
    """``TEXT_ROWS`` one-turn text rollouts in 2 groups (rewards alternate 1, 0), logprobs 0."""
    from gymbridge.tensors import MediaProcessor, TrainBatch
    from gymbridge.trajectory.types import Trajectory, Turn

    g = torch.Generator().manual_seed(seed)
    trajs = []
    for r in range(TEXT_ROWS):
        prompt = (torch.randint(40, 90, (prompt_len,), generator=g)).tolist()
        gen = [*torch.randint(40, 90, (3 + r % 4,), generator=g).tolist(), eos]
        turn = Turn(
            index=0,
            item_index=1,
            kind="message",
            segment=0,
            prompt_token_ids=prompt,
            generation_token_ids=gen,
            generation_logprobs=[0.0] * len(gen),
            media=[],
        )
        trajs.append(Trajectory(turns=[turn], reward=float(r % 2 == 0), task_index=r // 4, rollout_index=r))
    return TrainBatch.from_trajectories(trajs, MediaProcessor(processor), group_size=4)


def _current(model: Any, batch: Any) -> Any:
    from dataclasses import replace

    from gymbridge.trainer import token_logprobs

    with torch.no_grad():
        lp = token_logprobs(model, batch)
    return replace(batch, logprobs=lp * batch.loss_mask)


def scaled_qwen2_vl_config() -> Any:
    """The tiny Qwen2-VL's config at ~60M parameters (hidden 512, 8 layers, 32k vocab, 4 vision blocks)."""
    from gymbridge.models.tiny_vlm import build_tiny_vlm

    config = copy.deepcopy(build_tiny_vlm(0).model.config)
    text = config.text_config
    text.vocab_size, text.hidden_size, text.intermediate_size = 32000, 512, 1408
    text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads = 8, 8, 2
    text.head_dim = 64
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [8, 12, 12]}
    text.layer_types = ["full_attention"] * 8
    vision = config.vision_config
    vision.depth, vision.embed_dim, vision.num_heads, vision.hidden_size = 4, 256, 4, 512
    vision.out_hidden_size = 512
    return config


def _policy(job: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``(model, factory, batch)`` of a job: a tiny family's, or the scaled Qwen2-VL's (seed 0)."""
    from gymbridge.trainer.models import from_config

    if job["model"] == "scaled":
        from transformers import Qwen2VLForConditionalGeneration

        from gymbridge.models.tiny_vlm import build_tiny_vlm

        config = scaled_qwen2_vl_config()
        torch.manual_seed(0)
        model = from_config(Qwen2VLForConditionalGeneration, config)
        eos, processor = 2, build_tiny_vlm(0).processor
    else:
        from gymbridge.models.tiny_families import tiny_family_policy, tiny_model

        tiny = tiny_model(job["model"], 0)
        model = tiny_family_policy(job["model"], 0)
        eos, processor = int(tiny.model.generation_config.eos_token_id), tiny.processor
    factory = functools.partial(from_config, type(model), model.config)
    return model, factory, text_batch(processor, eos)


def _rank_main(rank: int, world: int, port: int, job: dict[str, Any], out: Any) -> None:
    import torch.distributed as dist

    from gymbridge.trainer import GRPOConfig, GRPOTrainer
    from gymbridge.trainer.grpo import loss_rows
    from gymbridge.trainer.ray_dp import FSDPWorker, fsdp_load_states, policy_shards

    torch.set_num_threads(1)
    config = GRPOConfig(lr=1e-3, micro_batch_max_tokens=64, encoder_dedup=False)
    model, factory, batch = _policy(job)
    driver = GRPOTrainer(model, config, on_policy=False)
    batch = _current(model, batch)
    result: dict[str, Any] = {"rank": rank}
    if rank == 0 and job["kind"] == "parity":
        local = GRPOTrainer(copy.deepcopy(model), config, on_policy=False)
        result["want_loss"] = local.step(batch).loss
        result["want"] = {n: p.detach().clone() for n, p in local.model.named_parameters()}
    worker = FSDPWorker(rank, world, factory, config, torch.float32)
    worker.join("127.0.0.1", port, "gloo", 600.0)
    worker.setup()
    lead, light = fsdp_load_states(driver)
    worker.load(lead if rank == 0 else light)
    del lead, light, driver
    shards = policy_shards(batch, world, torch.float32)
    part = worker.compute(shards[rank], int(batch.loss_mask.sum()), loss_rows(batch.loss_mask))
    assert part is not None
    losses: list[Any] = [None] * world
    dist.all_gather_object(losses, part.loss_sum)
    _, _, held = worker.apply(False)
    result["held"] = held
    result["loss"] = sum(losses)
    if job["kind"] == "parity":  # the published weights: one bucket of everything, gathered to rank 0
        names = [n for n, _ in worker._trainer().model.named_parameters()]
        got = worker.gather(names, torch.float32)
        if got is not None:
            gathered = got.tensors()
            want = result.pop("want")
            result["max_param_diff"] = max(float((gathered[n] - want[n]).abs().max()) for n in names)
    worker.close()
    out.put(result)


def run_group(job: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Run ``job`` on ``world`` gloo ranks; every rank's result, by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, job, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = []
    try:
        while len(results) < world:
            try:
                results.append(out.get(timeout=5))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a rank failed: {[p.exitcode for p in procs]}") from None
    finally:
        for p in procs:
            p.join(timeout=60)
    return sorted(results, key=lambda r: r["rank"])


def replicated_bytes(job: dict[str, Any]) -> dict[str, int]:
    """What one ``replicate`` rank holds after a step: the whole policy, its gradients, its AdamW."""
    from gymbridge.trainer import GRPOConfig, GRPOTrainer
    from gymbridge.trainer.sharding import resident_bytes

    model, _, batch = _policy(job)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-3, micro_batch_max_tokens=64), on_policy=False)
    res = trainer.compute_gradients(_current(model, batch))
    grads = sum(g.numel() * g.element_size() for g in res.grads)
    trainer.apply_gradients(res.grads)
    return {**resident_bytes(trainer.model, trainer.optimizer).as_dict(), "grads": grads}


def _timed_worker_class() -> type:
    """``FSDPWorker`` with the benchmark's timing calls (its actors run the real ``gather``)."""
    from gymbridge.trainer.ray_dp import FSDPWorker

    class TimedFSDPWorker(FSDPWorker):
        def time_gather(self, buckets: list[list[str]], dtype: torch.dtype) -> float:
            import torch.distributed as dist

            dist.barrier()
            started = time.perf_counter()
            for names in buckets:
                self.gather(names, dtype)
            dist.barrier()
            return time.perf_counter() - started

        def time_broadcast(self, sizes: list[int]) -> float:
            import torch.distributed as dist

            dist.barrier()
            started = time.perf_counter()
            for nbytes in sizes:
                dist.broadcast(torch.zeros(nbytes, dtype=torch.uint8), src=0)
            dist.barrier()
            return time.perf_counter() - started

        def broadcast_bucket(self, nbytes: int) -> Any:
            import torch.distributed as dist

            flat = torch.zeros(nbytes, dtype=torch.uint8)
            dist.broadcast(flat, src=0)
            return flat.numpy() if self.rank == 0 else None

    return TimedFSDPWorker


def publication(n: int, bucket_bytes: int, repeats: int) -> dict[str, Any]:
    """The four publication timings (module docstring) on ``n`` Ray FSDP actors, best of ``repeats``."""
    from transformers import Qwen2VLForConditionalGeneration

    from gymbridge.trainer import GRPOConfig, GRPOTrainer, RayDPTrainer, init_ray, ray_dp
    from gymbridge.trainer.models import from_config

    ray = init_ray(num_cpus=2)
    config = scaled_qwen2_vl_config()
    torch.manual_seed(0)
    model = from_config(Qwen2VLForConditionalGeneration, config)
    factory = functools.partial(from_config, Qwen2VLForConditionalGeneration, config)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-3, encoder_dedup=False), on_policy=False)
    plain, ray_dp.FSDPWorker = ray_dp.FSDPWorker, _timed_worker_class()  # type: ignore[misc]
    try:
        dp = RayDPTrainer(trainer, factory, n, worker_num_cpus=0, strategy="fsdp", bucket_bytes=bucket_bytes)
    finally:
        ray_dp.FSDPWorker = plain  # type: ignore[misc]
    params = dict(model.named_parameters())
    buckets = dp.publish_buckets()
    sizes = [sum(params[k].numel() * params[k].element_size() for k in names) for names in buckets]
    sink = torch.empty(max(sizes), dtype=torch.uint8)
    want = {k: v.detach().clone() for k, v in params.items()}
    best: dict[str, float] = {}
    try:
        for _ in range(repeats):
            times = {"gather_s": max(ray.get([w.time_gather.remote(buckets, dp.dtype) for w in dp.workers]))}
            with torch.no_grad():
                for p in params.values():
                    p.zero_()
            started = time.perf_counter()
            dp._publish_from_shards()
            times["gather_ray_s"] = time.perf_counter() - started
            assert all(torch.equal(params[k], want[k]) for k in want), "publication changed the weights"
            times["broadcast_s"] = max(ray.get([w.time_broadcast.remote(sizes) for w in dp.workers]))
            started = time.perf_counter()
            for nbytes in sizes:
                got = ray.get([w.broadcast_bucket.remote(nbytes) for w in dp.workers])[0]
                sink[:nbytes].copy_(torch.from_numpy(got))
                del got
            times["broadcast_ray_s"] = time.perf_counter() - started
            best = {k: min(v, best.get(k, v)) for k, v in times.items()}
    finally:
        dp.shutdown()
    return {"bytes": sum(sizes), "buckets": len(buckets), **best}


def _mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def main() -> None:
    from gymbridge.models.tiny_families import TINY_FAMILIES

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="*", default=sorted(TINY_FAMILIES))
    parser.add_argument("--ranks", nargs="*", type=int, default=[1, 2, 4])
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="publication: best of this many")
    parser.add_argument("--only", nargs="*", default=["parity", "bytes", "publish"])
    parser.add_argument("--json", default=None, help="also write the numbers to this path")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    bucket_bytes = args.bucket_mb << 20
    report: dict[str, Any] = {"parity": {}, "bytes": {}, "publish": {}}

    if "parity" in args.only:
        print("parity: one fp32 GRPO step, 2 FSDP ranks vs one process (text-only batch)")
        print(f"{'family':<14} {'|d loss|':>10} {'max |d param|':>14}")
        for family in args.families:
            res = run_group({"kind": "parity", "model": family, "bucket_bytes": bucket_bytes}, 2)[0]
            d_loss = abs(res["loss"] - res["want_loss"])
            report["parity"][family] = {"loss_diff": d_loss, "max_param_diff": res["max_param_diff"]}
            print(f"{family:<14} {d_loss:>10.2e} {res['max_param_diff']:>14.2e}")

    if "bytes" in args.only:
        job = {"kind": "bytes", "model": "scaled", "bucket_bytes": bucket_bytes}
        rep = replicated_bytes(job)
        total = sum(rep.values())
        print(
            f"\nresident state per rank, MiB (scaled Qwen2-VL, {rep['params'] / 4 / 1e6:.1f}M fp32 "
            "parameters)"
        )
        print(
            f"{'N':>2} {'strategy':<10} {'params':>8} {'grads':>8} {'optim':>8} {'total':>8} "
            f"{'/ replicate':>11}"
        )
        for n in args.ranks:
            print(
                f"{n:>2} {'replicate':<10} {_mib(rep['params'])} {_mib(rep['grads'])} "
                f"{_mib(rep['optimizer'])} {_mib(total)} {1.0:>11.3f}"
            )
            results = run_group(job, n)
            worst = max(results, key=lambda r: sum(r["held"].values()))["held"]
            ratio = sum(worst.values()) / total
            report["bytes"][n] = {"replicate": rep, "fsdp_max_rank": worst, "ratio": ratio}
            print(
                f"{n:>2} {'fsdp':<10} {_mib(worst['params'])} {_mib(worst['grads'])} "
                f"{_mib(worst['optimizer'])} {_mib(sum(worst.values()))} {ratio:>11.3f}"
            )

    if "publish" in args.only:
        print(
            f"\npublication of the whole policy (scaled Qwen2-VL, fp32), {args.bucket_mb} MiB buckets, "
            f"Ray actors on gloo, best of {args.repeats}; ratios: / raw broadcast"
        )
        head = f"{'N':>2} {'MiB':>8} {'gather s':>9} {'+Ray s':>8} {'bcast s':>8} {'bcast+Ray s':>12}"
        print(f"{head} {'gather/bc':>10} {'+Ray/bc':>8} {'+Ray/bc+Ray':>12}")
        for n in args.ranks:
            r = publication(n, bucket_bytes, args.repeats)
            report["publish"][n] = r
            bc, bcr = max(r["broadcast_s"], 1e-9), max(r["broadcast_ray_s"], 1e-9)
            print(
                f"{n:>2} {_mib(r['bytes'])} {r['gather_s']:>9.3f} {r['gather_ray_s']:>8.3f} "
                f"{r['broadcast_s']:>8.3f} {r['broadcast_ray_s']:>12.3f} {r['gather_s'] / bc:>10.2f} "
                f"{r['gather_ray_s'] / bc:>8.2f} {r['gather_ray_s'] / bcr:>12.2f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)


if __name__ == "__main__":
    main()
