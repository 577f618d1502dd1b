"""The bridge + trainer as library calls, against servers you already run.

    gymbridge env serve circle_click --port 8001 &
    gymbridge model serve --tiny --port 8002 &
    # an agent (gymbridge's SimpleAgent or genuine simple_agent) on :8003, then:
    python examples/bridge_loop.py --agent http://127.0.0.1:8003 --data rows.jsonl

Each step: G rollouts per prompt through the agent's /run, one TrainBatch, one GRPO step on a
local copy of the tiny policy (a real run would push the new weights to the generator).
"""

from __future__ import annotations

import argparse
import asyncio

from gymbridge.bridge import BridgeConfig, BridgeIterator, GymRollouts
from gymbridge.client import GymClient
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.tensors import MediaProcessor
from gymbridge.trainer import GRPOConfig, GRPOTrainer, tiny_policy


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--agent", required=True, help="agent base URL (POST /run)")
    parser.add_argument("--data", required=True, help="dataset jsonl")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    tiny = build_tiny_vlm(0)
    trainer = GRPOTrainer(tiny_policy(0), GRPOConfig(lr=1e-4))
    async with GymClient(args.agent, deadline_s=300) as client:
        bridge = BridgeIterator(
            args.data,
            GymRollouts(client),
            MediaProcessor(tiny.processor),
            BridgeConfig(
                group_size=args.group_size,
                prompts_per_step=args.prompts,
                min_group_size=min(args.group_size, max(2, args.group_size // 2)),
            ),
            failures_path="failures.jsonl",
        )
        step = 0
        async for batch in bridge:
            metrics = await asyncio.to_thread(trainer.step, batch)
            step += 1
            print(
                f"step {step}: reward {metrics.mean_reward:.3f} loss {metrics.loss:+.5f} "
                f"tokens {metrics.num_tokens}"
            )
            if step == args.steps:
                break
        await bridge.aclose()
        print(bridge.stats.as_dict())


if __name__ == "__main__":
    asyncio.run(main())
