"""``gymbridge train``: the smoke launcher's loop on a user's setup (environment, dataset, model).

::

    gymbridge train --env my_pkg.envs:MyEnv --dataset rows.jsonl [--model tiny | PATH] [--backend hf | vllm]
    gymbridge train --agent-url http://127.0.0.1:8000 --dataset rows.jsonl --model-port 8010
    gymbridge train --config my.yaml [--set trainer.lr=1e-3 ...]

It is :func:`gymbridge.launch.smoke.run_smoke` with four more settings (``SmokeConfig`` keys,
settable in the YAML or with ``--set`` too): ``env`` may be ``module:Class`` (a user's
:class:`~gymbridge.server.ResourcesServer`, started by the launcher beside our agent and model
server), ``agent_url`` (any NeMo Gym agent, a genuine nemo-gym deployment included: the run
starts only the model server, on ``model_port``, which that agent is configured to call),
``dataset`` (NeMo Gym rows, validated line by line before anything starts) and ``model`` /
``backend`` (``tiny`` or a local Hugging Face model directory; ``vllm`` runs it in a child
``gymbridge model serve --backend vllm``, GPU only). The run directory, ``metrics.jsonl``,
charts, viewer, checkpoints and ``--resume`` are the smoke launcher's.

Invariant: one loop. Nothing here trains; it only turns the command line into a ``SmokeConfig``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from gymbridge.errors import ConfigError

__all__ = ["add_train_arguments"]


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """``gymbridge train``'s options: the smoke launcher's plus the user's setup."""
    from gymbridge.launch.smoke import add_smoke_arguments

    add_smoke_arguments(parser)
    for action in parser._actions:  # the same --env, now also module:Class
        if action.dest == "env":
            action.help = "environment: a name (gymbridge env list) or module:Class (your ResourcesServer)"
    parser.add_argument(
        "--agent-url",
        default=None,
        help="a running NeMo Gym agent (POST /run): the run serves the model only",
    )
    parser.add_argument("--dataset", default=None, help="NeMo Gym rows (jsonl) to train on")
    parser.add_argument(
        "--model", default=None, help="tiny (default) or a local Hugging Face model directory"
    )
    parser.add_argument(
        "--backend", choices=("hf", "vllm"), default=None, help="generation backend of --model"
    )
    parser.add_argument(
        "--model-port", type=int, default=None, help="the model server's port (for --agent-url's agent)"
    )
    parser.set_defaults(func=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    from gymbridge.launch.smoke import SmokeConfig, build_config, resume_config, run_smoke

    # every flag named after a config key (--steps, --agent-url, ...); applied after --config and --set
    flags = {k: v for k, v in vars(args).items() if k in SmokeConfig.model_fields}
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.resume is not None:
        given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None]
        given += [f"--set {o.partition('=')[0]}" for o in args.overrides]
        if given or args.config:
            raise ConfigError([f"--resume continues the run saved in {args.resume}; drop {', '.join(given)}"])
        run_smoke(resume_config(Path(args.resume)), progress=not args.no_progress, resume=True)
        return 0
    overrides = list(args.overrides)
    if args.backend == "vllm" and not any(o.startswith("generator.placement=") for o in overrides):
        overrides.insert(0, "generator.placement=process")  # vLLM serves from its own process
    cfg = build_config(args.config, overrides, flags)
    run_smoke(cfg, progress=not args.no_progress)
    return 0
