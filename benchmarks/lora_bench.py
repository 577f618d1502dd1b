"""LoRA against full fine-tuning on one random Qwen2-VL of a few tens of millions of parameters:
the bytes one publication sends, the seconds it takes, and what the trainer holds.

* **published bytes**: :func:`gymbridge.trainer.weight_sync.payload_bytes` of the policy, full
  weights against LoRA rank 8 on the language model's attention and MLP projections (the
  ``trainer.lora`` defaults; the vision tower frozen);
* **sync seconds**: the same publication, interleaved round by round (full, LoRA, full, ...), by
  ``InProcessPublisher`` (a copy into a generator's own model) and by ``DistributedPublisher`` over
  ``shared_memory`` and ``broadcast`` to a ``ModelServer`` with a ``WeightReceiver`` on a thread of this
  process (the routes ``gymbridge model serve --enable-weight-updates`` opens; the server injects the
  adapters from ``init_group``'s ``lora``). Medians of ``--syncs`` rounds, and their ratio;
* **trainer state**: after one AdamW step on a random text batch, the bytes of parameters,
  gradients and optimizer state (what full fine-tuning and LoRA keep resident between steps).

Not part of the test suite; docs/benchmarks.md ("LoRA") has a run.

    .venv/bin/python benchmarks/lora_bench.py [--syncs 5] [--rank 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

from gymbridge.generation.lora import LoRAConfig, apply_lora

CONFIG = Qwen2VLConfig(
    text_config={
        "vocab_size": 32000,
        "hidden_size": 512,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 10000.0},
    },
    vision_config={"depth": 4, "embed_dim": 256, "hidden_size": 512, "num_heads": 4},
    tie_word_embeddings=False,
)


def build(rank: int) -> Any:
    """The random model, seed 0 (the same weights every call), with LoRA of ``rank`` (0: none)."""
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(CONFIG).eval()
    if rank:
        apply_lora(model, LoRAConfig(rank=rank))
    return model


def state_bytes(model: Any) -> dict[str, int]:
    """Parameters, gradients and AdamW state after one step on random text (bytes each)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids).logits.float().mean().backward()
    optimizer.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    adam = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    return {"params": params, "grads": grads, "adam": adam}


@contextmanager
def served() -> Iterator[str]:
    """A model server on a thread of this process, serving a fresh copy of the model (no adapters:
    a LoRA trainer's ``init_group`` injects them)."""
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.generation.weights import WeightReceiver
    from gymbridge.models.tiny_vlm import build_tiny_vlm
    from gymbridge.testing.model_server import served_in_thread

    gen = HFGenerator(build(0), build_tiny_vlm(0).processor, max_model_len=256)
    with served_in_thread(gen, WeightReceiver(gen)) as url:
        yield url


def main() -> None:
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.models.tiny_vlm import build_tiny_vlm
    from gymbridge.testing.model_server import TESTING_WEIGHTS_SECRET
    from gymbridge.trainer.weight_sync import DistributedPublisher, InProcessPublisher, payload_bytes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()

    trainers = {"full": build(0), "lora": build(args.rank)}
    total = sum(p.numel() for p in trainers["full"].parameters())
    print(f"model: random Qwen2-VL, {total / 1e6:.1f} M parameters (fp32); LoRA rank {args.rank}")
    sent = {k: payload_bytes(m) for k, m in trainers.items()}
    print(
        f"published per step: full {sent['full'] / 2**20:.1f} MiB, LoRA {sent['lora'] / 2**20:.2f} MiB "
        f"({100 * sent['lora'] / sent['full']:.2f}% of full)"
    )

    times: dict[tuple[str, str], list[float]] = {}
    with served() as full_url, served() as lora_url:
        publishers: dict[tuple[str, str], Callable[[Any, int], float]] = {}
        processor = build_tiny_vlm(0).processor
        for kind in trainers:
            target = HFGenerator(build(args.rank if kind == "lora" else 0), processor, max_model_len=256)
            publishers[("in-process", kind)] = InProcessPublisher(target).publish
        closers = []
        version = 0
        for transport in ("shared_memory", "broadcast"):
            for kind, url in (("full", full_url), ("lora", lora_url)):
                pub = DistributedPublisher(  # type: ignore[arg-type]
                    url, timeout_s=120, transport=transport, secret=TESTING_WEIGHTS_SECRET
                )
                publishers[(transport, kind)] = pub.publish
                closers.append(pub)
            for round_ in range(args.syncs + 1):  # round 0 sets the transport up: not counted
                version += 1  # a server's versions only go up, across transports too
                for kind in ("full", "lora"):
                    started = time.perf_counter()
                    publishers[(transport, kind)](trainers[kind], version)
                    if round_ > 0:
                        times.setdefault((transport, kind), []).append(time.perf_counter() - started)
            for pub in closers:
                pub.close()
            closers.clear()
            # a server keeps one transport's segments mapped: the next transport starts afresh
        for version in range(1, args.syncs + 1):
            for kind in ("full", "lora"):
                started = time.perf_counter()
                publishers[("in-process", kind)](trainers[kind], version)
                times.setdefault(("in-process", kind), []).append(time.perf_counter() - started)

    print(f"\nsync seconds, median of {args.syncs} interleaved rounds:")
    print(f"{'transport':<14} {'full':>10} {'LoRA':>10} {'full / LoRA':>12}")
    for transport in ("in-process", "shared_memory", "broadcast"):
        full = statistics.median(times[(transport, "full")])
        lora = statistics.median(times[(transport, "lora")])
        print(f"{transport:<14} {full:>10.4f} {lora:>10.4f} {full / lora:>11.1f}x")

    print("\ntrainer state after one AdamW step (MiB):")
    print(f"{'':<6} {'params':>9} {'grads':>9} {'adam':>9} {'total':>9}")
    for kind in ("full", "lora"):
        held = state_bytes(build(args.rank if kind == "lora" else 0))
        row = " ".join(f"{v / 2**20:>9.1f}" for v in held.values())
        print(f"{kind:<6} {row} {sum(held.values()) / 2**20:>9.1f}")


if __name__ == "__main__":
    main()
