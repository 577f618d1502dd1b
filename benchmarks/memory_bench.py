"""Peak memory of one GRPO step with each memory setting (docs/memory.md), tiny Qwen2-VL, CPU.

One batch of 4 rows sharing a long prompt (one 56 px image, ``--prompt-tokens`` text tokens) with
32-token completions: the shape where a step's memory goes to the prompt's activations and to
logits nobody reads. Each setting runs ``trainer.step`` on a fresh copy of the same model:

* ``full logits``: the output head and log-softmax at every position (the trainer before lean logits);
* ``lean``: only at the positions whose next token is a loss token (``scored_logprobs``);
* ``+ AC``: activation checkpointing of every block; ``+ frozen``: the vision tower frozen too;
* ``bf16 cast``: the policy cast to bf16 with full logits (no master copy: the run before);
* ``bf16 masters``: fp32 weights and AdamW state, the forward under bf16 autocast, lean + AC.

Memory is measured as torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) does it,
without its module hooks (they refuse frozen parameters): a ``TorchDispatchMode`` sees every tensor
storage the step's ops return (forward, backward, optimizer) and a weak reference sees it freed, so
the peak is the largest sum of live tensor bytes (the weights and buffers counted from the start),
whatever the CPU allocator keeps cached. That is what a GPU allocator would have to hold; the
process's RSS is not comparable across settings (glibc keeps freed pages). ``--vocab`` rebuilds the
model with a larger output vocabulary (random weights; the tiny one has 512 tokens where real VLMs have 150k),
where the logits dominate. Seconds are the median of ``--repeats`` untracked steps.

    .venv/bin/python benchmarks/memory_bench.py
    .venv/bin/python benchmarks/memory_bench.py --prompt-tokens 4000 --vocab 512 32768
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import statistics
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from gymbridge.media import MediaItem
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.tensors import MediaProcessor, TrainBatch
from gymbridge.trainer import GRPOConfig, GRPOTrainer, forward, token_logprobs
from gymbridge.trainer.memory import prepare_policy
from gymbridge.trainer.models import from_config
from gymbridge.trajectory.types import Trajectory, Turn


def build_batch(prompt_tokens: int, completion_tokens: int = 32, rows: int = 4) -> TrainBatch:
    tiny = build_tiny_vlm(0)
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 40, 40)).save(buf, format="PNG")
    image = MediaItem.from_bytes(buf.getvalue(), "image", mime="image/png")
    text = [40 + i % 200 for i in range(prompt_tokens)]
    prompt = [tiny.im_start_token_id, tiny.vision_start_token_id, *[tiny.image_token_id] * 4]
    prompt += [tiny.vision_end_token_id, *text]
    trajs = []
    for r in range(rows):
        gen = [60 + (i * 7 + r) % 40 for i in range(completion_tokens - 1)] + [tiny.eos_token_id]
        turn = Turn(0, 1, "message", 0, prompt, gen, [0.0] * completion_tokens, media=[image])
        trajs.append(Trajectory(turns=[turn], reward=float(r % 2), task_index=0, rollout_index=r))
    return TrainBatch.from_trajectories(trajs, MediaProcessor(tiny.processor), group_size=rows)


def model_with_vocab(vocab: int) -> Any:
    base = build_tiny_vlm(0).model
    if vocab == base.config.text_config.vocab_size:
        return copy.deepcopy(base)
    config = copy.deepcopy(base.config)
    config.text_config.vocab_size = vocab
    torch.manual_seed(0)
    return from_config(type(base), config)


@contextlib.contextmanager
def full_logits() -> Iterator[None]:
    """The trainer's forward as before lean logits: the head over every position."""
    lean = forward._base_and_head
    forward._base_and_head = lambda model: None
    try:
        yield
    finally:
        forward._base_and_head = lean


class LiveBytes(TorchDispatchMode):
    """The largest sum of live tensor storage bytes while active (``peak``), from ``start`` tensors on."""

    def __init__(self, start: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        for t in start:
            self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen and self._seen[key]() is storage:
            return
        size = storage.nbytes()

        def freed(_: object, key: int = key, size: int = size) -> None:
            self.live -= size
            self._seen.pop(key, None)

        self._seen[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._add, out)
        return out


@dataclass(frozen=True)
class Setting:
    name: str
    config: dict[str, Any]
    full: bool = False
    cast: bool = False
    """Cast the policy to the config's dtype (no master copy), as the run did before."""


SETTINGS = (
    Setting("full logits", {}, full=True),
    Setting("lean", {}),
    Setting("lean + AC", {"activation_checkpointing": True}),
    Setting("lean + AC + frozen", {"activation_checkpointing": True, "freeze_vision_tower": True}),
    Setting("bf16 cast, full logits", {"dtype": "bfloat16"}, full=True, cast=True),
    Setting("bf16 masters, lean + AC", {"dtype": "bfloat16", "activation_checkpointing": True}),
)


def measure(model: Any, batch: TrainBatch, setting: Setting, repeats: int) -> tuple[int, int, float]:
    """``(peak bytes, peak bytes beyond the weights, seconds per step)`` of ``setting``'s step."""
    config = GRPOConfig(lr=1e-6, ratio_tolerance=None, **setting.config)

    def trainer() -> GRPOTrainer:
        policy = copy.deepcopy(model)
        prepare_policy(policy, config, masters=not setting.cast)
        if setting.cast:
            policy.to(config.torch_dtype)
        return GRPOTrainer(policy, config)

    with full_logits() if setting.full else contextlib.nullcontext():
        seconds = []
        for _ in range(repeats):
            t = trainer()
            started = time.perf_counter()
            t.step(batch)
            seconds.append(time.perf_counter() - started)
        t = trainer()
        weights = [*t.model.parameters(), *t.model.buffers()]
        if t.reference is not None:
            weights += [*t.reference.parameters(), *t.reference.buffers()]
        with LiveBytes(weights) as tracker:
            t.step(batch)
    held = sum(w.untyped_storage().nbytes() for w in {id(w): w for w in weights}.values())
    return tracker.peak, tracker.peak - held, statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--vocab", type=int, nargs="+", default=[512, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    batch = build_batch(args.prompt_tokens)
    print(
        f"{len(batch)} rows x {batch.seq_len} tokens ({int(batch.loss_mask.sum())} loss tokens), "
        "one trainer.step each; MiB of live tensors at the peak (weights, gradients, AdamW state, "
        "activations), and beyond the weights"
    )
    header = f"{'vocab':>6} {'setting':<26} {'peak MiB':>9} {'x full':>7} {'- weights':>10} {'s/step':>7}"
    print(header)
    print("-" * len(header))
    for vocab in args.vocab:
        model = model_with_vocab(vocab)
        with torch.no_grad():
            lp = token_logprobs(model, batch)
        scored = replace(batch, logprobs=lp * batch.loss_mask)
        base: int | None = None
        for setting in SETTINGS:
            peak, acts, seconds = measure(model, scored, setting, args.repeats)
            base = base or peak
            print(
                f"{vocab:>6} {setting.name:<26} {peak / 2**20:>9.1f} {peak / base:>7.2f} "
                f"{acts / 2**20:>10.1f} {seconds:>7.3f}"
            )


if __name__ == "__main__":
    main()
