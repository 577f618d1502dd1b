"""TRL's GRPOTrainer on a bundled NeMo Gym environment: ``python examples/train_trl.py [--steps N]``.

Needs ``pip install -e '.[trl]'``; offline, on CPU, a few minutes. The environment is
``color_pick`` with ``reveal: tool``: the prompt holds no image, the ``look`` tool answers with
an image of the colour to name, and the reward is the server's ``/verify``.
:func:`gymbridge.integrations.trl.gym_environment` serves ``ColorPickServer`` on 127.0.0.1 and
hands TRL an ``environment_factory`` (``reset`` -> ``/seed_session``, one method per Gym tool,
tool images as image blocks) and a reward function; TRL's own tool loop plays the episodes.

The model is gymbridge's tiny random-weight Qwen2-VL, which would never write a tool call: a
short supervised warm-up (:mod:`gymbridge.testing.trl_format`) teaches it the call format first
(the ``look`` call, then either colour word after an image of a third colour, so the answer is
not learned from it). With a real VLM, drop the warm-up and pass your model and processor
(``docs/integrations.md``, "gym_environment: TRL plays the tools").
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

COLORS = ("red", "green")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps (default 4)")
    parser.add_argument("--rows", type=int, default=16, help="dataset rows (default 16)")
    parser.add_argument("--output-dir", default=None, help="TRL's output_dir (default: a temporary folder)")
    args = parser.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from gymbridge.integrations.trl import gym_environment, trl_rows
    from gymbridge.testing.trl_format import encode, encode_after_tool, tiny_for_trl, tool_call, warm_up
    from gymbridge_envs.color_pick.data import generate, render
    from gymbridge_envs.color_pick.server import ColorPickServer

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the tiny model: more threads only spin
    tiny = tiny_for_trl()
    rows = list(generate(args.rows, 0, colors=",".join(COLORS), reveal="tool"))
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="gymbridge-trl-")

    with gym_environment(ColorPickServer, processing_class=tiny.processing_class) as env:
        print(f"tools TRL will call: {sorted(env.tool_names)}")
        probe = env()
        tools = [getattr(probe, name) for name in sorted(env.tool_names)]
        user = [{"role": "user", "content": rows[0]["responses_create_params"]["input"][0]["content"]}]
        first = encode(tiny.processing_class, user, tools, tool_call("look"))
        shown: list[dict[str, Any]] = [
            {"type": "text", "text": "The image:"},
            {"type": "image", "image": render("blue", 56)},  # a colour no row asks about
        ]
        looked = {"role": "tool", "name": "look", "content": shown}
        answers = [encode_after_tool(tiny.processing_class, first, looked, word) for word in COLORS]
        loss = warm_up(tiny, [([first], 100), ([first, *answers], 30), ([first], 20)])
        print(f"format warm-up done (loss {loss:.3f})")

        trainer = GRPOTrainer(
            model=tiny.model,
            processing_class=tiny.processing_class,
            reward_funcs=[env.reward_func],  # POST /verify in each rollout's own session
            environment_factory=env,
            train_dataset=Dataset.from_list(trl_rows(rows)),
            args=GRPOConfig(
                output_dir=output_dir, per_device_train_batch_size=8, num_generations=4,
                max_completion_length=96, max_steps=args.steps, learning_rate=5e-3, temperature=0.7,
                max_tool_calling_iterations=2, beta=0.0, logging_steps=1, report_to="none",
                use_cpu=True, bf16=False, save_strategy="no", dataloader_num_workers=0, seed=0,
            ),
        )  # fmt: skip
        trainer.train()

    for entry in trainer.state.log_history:
        if "rewards/gym_verify/mean" in entry:
            print(
                f"step {entry['step']}: env reward {entry['rewards/gym_verify/mean']:.3f}, "
                f"tool calls per rollout {entry.get('tools/call_frequency', 0.0):.2f}"
            )
    print(f"failed environment sessions: {len(env.failures)}")
    print(f"TRL output_dir: {output_dir}")


if __name__ == "__main__":
    main()
