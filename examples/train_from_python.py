"""A GRPO run from Python: ``python examples/train_from_python.py [--steps N]``.

The same run as ``gymbridge smoke run``: the shipped ``smoke`` overlay (the colour toy on the tiny
random-weight model) with two settings changed in code, then :func:`gymbridge.run.train`, which
starts the servers on 127.0.0.1, trains, writes the run directory and stops everything.
"""

from __future__ import annotations

import argparse

from gymbridge.run import load_run_config, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    config = load_run_config(["smoke"], overrides=["bridge.group_size=8"], flags={"steps": args.steps})
    summary = train(config)
    print(f"env reward per step: {[round(r, 3) for r in summary.env_rewards]}")
    print(f"run directory: {summary.run_dir}")


if __name__ == "__main__":
    main()
