"""TRL's GRPOTrainer on a bundled NeMo Gym environment: ``python examples/train_trl.py [--seed S]``.

Needs ``pip install -e '.[trl]'``; offline, on CPU, about three minutes. The environment is
``color_pick`` with ``reveal: tool``: the prompt holds no image, the ``look`` tool answers with
an image of the colour to name, and the reward is the server's ``/verify``.
:func:`gymbridge.integrations.trl.gym_environment` serves ``ColorPickServer`` on 127.0.0.1 and
hands TRL an ``environment_factory`` (``reset`` -> ``/seed_session``, one method per Gym tool,
tool images as image blocks) and a reward function; TRL's own tool loop plays the episodes.

The model is gymbridge's tiny random-weight Qwen2-VL, which would never write a tool call. A
supervised format warm-up (:func:`gymbridge.testing.trl_format.warm_up`) trains it until it
writes the ``look`` call and, after a tool image of either colour, either colour word (both words
after each image: the answer is left at chance), or stops with an error. GRPO must then learn
which word each image means from the env reward alone; the last line compares the mean env
reward of the first and the last steps. What keeps that robust (measured: docs/integrations.md):
each step takes one block of rows in dataset order, one prompt of each colour, so the part of the
answer gradient that ignores the image cancels instead of pushing one word; and the sampled
~20-token call, whose gradient cancels within a group, is held by a KL term to the warmed-up
model (``beta``; TRL loads policy and reference from ``OUTPUT_DIR/warmed-up``) and by
``adam_epsilon=1e-5`` (AdamW moves a weight that sees only that float remainder by less than a
full step). With a real VLM, drop the warm-up and pass your model and processor
(``docs/integrations.md``, "gym_environment: TRL plays the tools").
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

COLORS = ("red", "green")
IMG_SIZE = 224  # 64 image tokens: at 56 px (4 of ~380 tokens) the 2-layer model barely sees the image
REPORT_STEPS = 10  # the first and the last this many steps are compared


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=80, help="GRPO steps (default 80)")
    parser.add_argument("--rows", type=int, default=64, help="dataset rows, even (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="rows, sampling, shuffling (default 0)")
    parser.add_argument("--output-dir", default=None, help="TRL's output_dir (default: a temporary folder)")
    args = parser.parse_args()
    if args.rows % len(COLORS):  # each step's two prompts are one block of rows: one of each colour
        parser.error(f"--rows must be a multiple of {len(COLORS)}")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from gymbridge.integrations.trl import gym_environment, trl_rows
    from gymbridge.testing.trl_format import tiny_for_trl
    from gymbridge_envs.color_pick.data import generate
    from gymbridge_envs.color_pick.server import ColorPickServer

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the tiny model: more threads only spin
    rows = list(generate(args.rows, args.seed, colors=",".join(COLORS), reveal="tool", img_size=IMG_SIZE))
    output_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="gymbridge-trl-"))
    tiny = tiny_for_trl()

    with gym_environment(ColorPickServer, processing_class=tiny.processing_class) as env:
        print(f"tools TRL will call: {sorted(env.tool_names)}")
        warmed = warm_up_format(tiny, env, rows, output_dir / "warmed-up")
        # TRL suppresses a sampled image placeholder; a sampled video one would crash its M-RoPE pass
        media_pads = [tiny.model.config.image_token_id, tiny.model.config.video_token_id]
        trainer = GRPOTrainer(
            model=str(warmed),  # policy and KL reference, both loaded from the warmed-up weights
            processing_class=tiny.processing_class,
            reward_funcs=[env.reward_func],  # POST /verify in each rollout's own session
            environment_factory=env,
            train_dataset=Dataset.from_list(trl_rows(rows)),
            args=GRPOConfig(
                output_dir=str(output_dir), per_device_train_batch_size=16, num_generations=8,
                max_completion_length=128, max_steps=args.steps, learning_rate=2e-3,
                lr_scheduler_type="constant_with_warmup", warmup_steps=10, adam_epsilon=1e-5, beta=0.3,
                max_tool_calling_iterations=2, generation_kwargs={"suppress_tokens": media_pads},
                shuffle_dataset=False, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                save_strategy="no", dataloader_num_workers=0, seed=args.seed,
            ),
        )  # fmt: skip
        trainer.train()

    report(trainer.state.log_history)
    print(f"failed environment sessions: {len(env.failures)}")
    print(f"TRL output_dir: {output_dir}")


def warm_up_format(tiny: Any, env: Any, rows: list[dict[str, Any]], out: Path) -> Path:
    """Teach ``tiny`` (a ``TinyForTRL``) the call and the answer format; save it to ``out``."""
    from gymbridge.testing.trl_format import encode, encode_after_tool, tool_call, warm_up
    from gymbridge_envs.color_pick.data import render

    probe = env()
    tools = [getattr(probe, name) for name in sorted(env.tool_names)]
    user = [{"role": "user", "content": rows[0]["responses_create_params"]["input"][0]["content"]}]
    first = encode(tiny.processing_class, user, tools, tool_call("look"))
    answers = []
    for color in COLORS:  # every word after every image: the format, not the answer
        shown = [{"type": "text", "text": "The image:"}, {"type": "image", "image": render(color, IMG_SIZE)}]
        looked = {"role": "tool", "name": "look", "content": shown}
        answers += [encode_after_tool(tiny.processing_class, first, looked, word) for word in COLORS]
    done = warm_up(tiny, [first, *answers])
    print(f"format warm-up: learned in {done.steps} steps (loss {done.loss:.3f})")
    tiny.model.save_pretrained(out)
    return out


def report(log_history: list[dict[str, Any]]) -> None:
    """Each step's env reward and tool calls per rollout, then the first and the last steps' means."""
    rewards = []
    for entry in log_history:
        if "rewards/gym_verify/mean" in entry:
            rewards.append(entry["rewards/gym_verify/mean"])
            print(
                f"step {entry['step']}: env reward {rewards[-1]:.3f}, "
                f"tool calls per rollout {entry.get('tools/call_frequency', 0.0):.2f}"
            )
    k = max(1, min(REPORT_STEPS, len(rewards) // 2))
    if rewards:
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        print(f"env reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")


if __name__ == "__main__":
    main()
