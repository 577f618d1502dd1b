"""Trainer step time with the media encoder run once per unique image vs once per reference.

Builds a GRPO batch of ``--prompts`` prompts, one ``--image-size`` square image each, times G
completions (G from ``--groups``, default 8 and 16), on the tiny offline Qwen2-VL with its image
processor allowed that many pixels (448x448: 32x32 patches, 256 placeholder tokens per image), and
times ``GRPOTrainer.compute_gradients`` (the step's forward + backward over every micro-batch;
the optimizer update, the same either way, is left out) with ``GRPOConfig.encoder_dedup`` on and
off, alternating, ``--repeats`` times each, in one process. Prints the median seconds, the
ratio off / on, the encoder's patch rows per step and the largest gradient difference between
the two (fp32: it must be ~1e-7 relative, the invariant of ``gymbridge/trainer/encoder.py``).
Not part of the test suite.

    .venv/bin/python benchmarks/encoder_bench.py [--groups 8 16] [--prompts 2] [--image-size 448]
        [--repeats 5] [--threads N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import io
import statistics
import time
from typing import Any

import torch


def image(size: int, k: int) -> Any:
    from PIL import Image

    from gymbridge.media import MediaItem

    gen = torch.Generator().manual_seed(k)
    pixels = torch.randint(0, 256, (size, size, 3), generator=gen, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return MediaItem.from_bytes(buf.getvalue(), "image", mime="image/png")


def build_batch(tiny: Any, processor: Any, *, prompts: int, group: int, size: int, gen_tokens: int) -> Any:
    from gymbridge.tensors import MediaProcessor, TrainBatch
    from gymbridge.trajectory.types import Trajectory, Turn

    media = MediaProcessor(processor)
    images = [image(size, k) for k in range(prompts)]
    done = media.process(images)
    trajs = []
    for p, img in enumerate(images):
        n = done[img.key].num_placeholders
        assert n is not None
        prompt = [tiny.im_start_token_id, 40, 41, tiny.vision_start_token_id, *[tiny.image_token_id] * n]
        prompt += [tiny.vision_end_token_id, 42, 43]
        for r in range(group):
            gen = [50 + (r * 7 + j) % 100 for j in range(gen_tokens - 1)] + [tiny.eos_token_id]
            turn = Turn(
                index=0,
                item_index=1,
                kind="message",
                segment=0,
                prompt_token_ids=prompt,
                generation_token_ids=gen,
                generation_logprobs=[-1.0] * len(gen),
                media=[img],
            )
            trajs.append(Trajectory(turns=[turn], reward=float(r % 2), task_index=p, rollout_index=r))
    return TrainBatch.from_trajectories(trajs, media, group_size=group)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from gymbridge.models.tiny_vlm import TinyImageProcessor, TinyVLMProcessor, build_tiny_vlm
    from gymbridge.trainer.grpo import GRPOConfig, GRPOTrainer

    tiny = build_tiny_vlm(0)
    area = args.image_size * args.image_size
    processor = TinyVLMProcessor(tiny.tokenizer, TinyImageProcessor.build(max_pixels=area))
    model = copy.deepcopy(tiny.model).to(args.device)
    trainers = {
        dedup: GRPOTrainer(
            model, GRPOConfig(encoder_dedup=dedup, micro_batch_max_tokens=1 << 20), on_policy=False
        )
        for dedup in (True, False)
    }

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    size = f"{args.image_size}x{args.image_size}"
    params = sum(p.numel() for p in model.parameters())
    print(
        f"tiny Qwen2-VL ({params} parameters), {args.prompts} prompts x G, "
        f"one {size} image per prompt, {args.gen_tokens} generated tokens per row, "
        f"device {args.device}, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(
        "| G | rows | tokens | patch rows encoded (on / off) | step on (s) | step off (s) | off / on "
        "| max grad diff (rel.) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for group in args.groups:
        batch = build_batch(
            tiny,
            processor,
            prompts=args.prompts,
            group=group,
            size=args.image_size,
            gen_tokens=args.gen_tokens,
        )
        patches = int(batch.media["image_grid_thw"].materialize().prod(dim=-1).sum())  # type: ignore[union-attr]
        unique = sum(int(s.prod()) for s in batch.media["image_grid_thw"].segments)
        times: dict[bool, list[float]] = {True: [], False: []}
        grads: dict[bool, list[torch.Tensor]] = {}
        for rep in range(args.repeats + 1):  # the first round warms up, untimed
            for dedup in (True, False) if rep % 2 == 0 else (False, True):
                sync()
                started = time.perf_counter()
                res = trainers[dedup].compute_gradients(batch)
                sync()
                if rep:
                    times[dedup].append(time.perf_counter() - started)
                grads[dedup] = res.grads
        diff = max(
            float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12)
            for a, b in zip(grads[True], grads[False], strict=True)
        )
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(
            f"| {group} | {len(batch)} | {batch.num_tokens} | {unique} / {patches} | {on:.3f} | {off:.3f} | "
            f"**{off / on:.2f}x** | {diff:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
