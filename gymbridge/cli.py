"""The ``gymbridge`` command line: a dispatch table of command groups.

::

    gymbridge env list
    gymbridge env data NAME --n N --seed S --out FILE [--param KEY=VALUE ...]
    gymbridge env serve NAME [--host H] [--port P]
    gymbridge model serve --tiny | --model PATH [--port P]
    gymbridge agent serve --resources-url URL --model-url URL [--port P]
    gymbridge smoke run [--config FILE] [--set KEY=VALUE ...]
    gymbridge export RUN_DIR --out DIR [--step N] [--dtype bfloat16|float32] [--max-shard-size 5GB]
    gymbridge eval RUN_DIR [--step N] | --model DIR --env NAME | --agent-url URL --data ROWS [-n K]

Each top-level group (``env``, ``model``, ``agent``, ``smoke``) is one entry of
:data:`COMMAND_GROUPS`: a help line and the dotted path of a function that adds
the group's subcommands to an ``argparse`` sub-parser and sets ``func`` on each.
A group's module is imported only when that group runs (or when ``--help`` lists
it), so a broken or heavy group never stops the others. Adding a group is one new
line in the table.

Invariants: library errors (:class:`~gymbridge.errors.GymbridgeError`) end the
process with exit code 2 and one readable message on stderr, never a traceback;
``main`` returns the exit code instead of calling ``sys.exit`` (testable).
The example environments (the repository's ``environments/`` folder) install as
``gymbridge_envs``, never as ``environments`` (nemo-gym's package of that name);
``env`` commands load them with :func:`load_example_environments`. This module is the top of
the package (it reaches every group); what the groups share with it (:func:`run_command`,
``--host`` / ``--port``, the environments' loader) is :mod:`gymbridge.cli_common`, below them all.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from gymbridge.cli_common import (
    DEFAULT_AGENT_PORT,
    DEFAULT_ENV_PORT,
    DEFAULT_MODEL_PORT,
    EXAMPLES_PACKAGE,
    add_address_arguments,
    load_example_environments,
    port_number,
    run_command,
)
from gymbridge.config import parse_key_value
from gymbridge.errors import ConfigError

__all__ = [
    "COMMAND_GROUPS",
    "DEFAULT_AGENT_PORT",
    "DEFAULT_ENV_PORT",
    "DEFAULT_MODEL_PORT",
    "EXAMPLES_PACKAGE",
    "add_address_arguments",
    "build_parser",
    "load_example_environments",
    "main",
    "port_number",
    "run_command",
]

logger = logging.getLogger(__name__)

AddCommands = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

COMMAND_GROUPS: dict[str, tuple[str, str]] = {
    "env": ("example environments: list, generate data, serve", "gymbridge.cli:add_env_commands"),
    "model": (
        "model server: serve a generator (tiny, HF or vLLM) over HTTP",
        "gymbridge.generation.cli:add_model_commands",
    ),
    "agent": (
        "the simple agent: drive an environment and a model server over HTTP (POST /run)",
        "gymbridge.server.cli:add_agent_commands",
    ),
    "smoke": (
        "the colour toy end to end on loopback (smoke run = train --config smoke)",
        "gymbridge.run.cli:add_smoke_commands",
    ),
}
"""Group name -> (help line, ``"module:function"`` adding its subcommands)."""

SINGLE_COMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "a GRPO run: --env NAME|module:Class or --agent-url URL, --dataset rows, --model tiny|PATH, --config",
        "gymbridge.run.cli:add_train_arguments",
    ),
    "export": (
        "write a run's trained weights as a Hugging Face model directory (from_pretrained, vLLM)",
        "gymbridge.run.cli:add_export_arguments",
    ),
    "eval": (
        "one validation pass (pass@k) of a run's checkpoint, a model directory or a running agent",
        "gymbridge.run.eval_cli:add_eval_arguments",
    ),
    "collect": (
        "roll a dataset out through any NeMo Gym agent (ng_collect_rollouts): results + failures",
        "gymbridge.run.collect:add_collect_arguments",
    ),
}
"""Commands without subcommands: name -> (help line, ``"module:function"`` adding its arguments)."""


# ---------------------------------------------------------------- env group
_environments = load_example_environments


def add_env_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``env list``, ``env data`` and ``env serve``."""
    p_list = sub.add_parser("list", help="list the example environments")
    p_list.add_argument("--params", action="store_true", help="also show each generator's parameters")
    p_list.set_defaults(func=_cmd_env_list)

    p_data = sub.add_parser(
        "data",
        help="write N dataset rows (stock Gym row shape, ready for /run) as JSON lines",
        description="Generate seeded rows; row i depends only on (seed, i, params).",
    )
    p_data.add_argument("name", help="environment name (see `gymbridge env list`)")
    p_data.add_argument("--n", type=int, required=True, help="number of rows")
    p_data.add_argument("--seed", type=int, default=0, help="dataset seed (default 0)")
    p_data.add_argument("--out", type=Path, required=True, help="output .jsonl file (written atomically)")
    p_data.add_argument(
        "--param",
        type=parse_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="generator parameter (YAML-typed value); `env list --params` shows them",
    )
    p_data.set_defaults(func=_cmd_env_data)

    p_serve = sub.add_parser("serve", help="serve an environment (NeMo Gym resources server) over HTTP")
    p_serve.add_argument("name", help="environment name (see `gymbridge env list`)")
    add_address_arguments(p_serve, DEFAULT_ENV_PORT)
    p_serve.add_argument(
        "--instance-name", default=None, help="instance name (session cookie suffix; default: the env name)"
    )
    p_serve.set_defaults(func=_cmd_env_serve)


def _cmd_env_list(args: argparse.Namespace) -> int:
    envs = _environments()
    width = max(len(spec.name) for spec in envs.list_envs())
    for spec in envs.list_envs():
        print(f"{spec.name:<{width}}  {spec.style:<9}  {','.join(spec.modalities):<6}  {spec.summary}")
        if args.params:
            described = spec.describe_params()
            for key, default in spec.generator_params().items():
                print(f"{'':<{width}}    --param {key}={default!r}  ({described[key]})")
    return 0


def _cmd_env_data(args: argparse.Namespace) -> int:
    if args.n < 0:
        raise ConfigError([f"--n must be >= 0, got {args.n}"])
    spec = _environments().get_env(args.name)
    if args.out.is_dir():
        raise ConfigError(
            [f"--out {args.out} is a directory: give a file path such as {args.out}/rows.jsonl"]
        )
    params = spec.check_params(dict(args.param))
    started = time.perf_counter()

    def rows() -> Iterator[dict[str, Any]]:
        from tqdm import tqdm

        yield from tqdm(
            spec.generate(args.n, args.seed, **params),
            total=args.n,
            desc=f"{spec.name} rows",
            unit="row",
            disable=None,  # only on a terminal
            file=sys.stderr,
        )

    write_jsonl = importlib.import_module(f"{EXAMPLES_PACKAGE}._common").write_jsonl

    try:
        count = write_jsonl(rows(), args.out)
    except (TypeError, ValueError) as exc:  # a generator refusing its parameters
        raise ConfigError([f"{spec.name} generator: {exc}"], source="--param") from exc
    except OSError as exc:  # a parent that is a file, no permission, a full disk
        raise ConfigError([f"--out {args.out}: cannot write it: {exc.strerror or exc}"]) from exc
    size_mib = args.out.stat().st_size / 2**20
    elapsed = time.perf_counter() - started
    summary = f"wrote {count} {spec.name} rows to {args.out} ({size_mib:.2f} MiB, {elapsed:.2f} s)"
    print(summary, file=sys.stderr)
    return 0


def _cmd_env_serve(args: argparse.Namespace) -> int:
    spec = _environments().get_env(args.name)
    from gymbridge.server import serve

    server = spec.make_server(instance_name=args.instance_name)

    def announce(url: str) -> None:
        print(f"serving {spec.name} on {url} (Ctrl-C to stop)", file=sys.stderr, flush=True)

    serve(server, host=args.host, port=args.port, announce=announce)
    return 0


# -------------------------------------------------------------------- parser
def _load_group(target: str) -> AddCommands:
    module_name, _, func_name = target.partition(":")
    func: AddCommands = getattr(importlib.import_module(module_name), func_name)
    return func


def build_parser(groups: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser with the given groups (all of :data:`COMMAND_GROUPS` by default)."""
    parser = argparse.ArgumentParser(prog="gymbridge", description="gymbridge: NeMo Gym <-> GRPO bridge")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level"
    )
    top = parser.add_subparsers(dest="group", metavar="GROUP", required=True)
    for name in groups if groups is not None else [*COMMAND_GROUPS, *SINGLE_COMMANDS]:
        if name in SINGLE_COMMANDS:
            help_line, target = SINGLE_COMMANDS[name]
            _load_group(target)(top.add_parser(name, help=help_line, description=help_line))  # type: ignore[arg-type]
            continue
        help_line, target = COMMAND_GROUPS[name]
        group_parser = top.add_parser(name, help=help_line, description=help_line)
        sub = group_parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
        _load_group(target)(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Build only the group being run (a broken group cannot break the others); all for --help.
    chosen = [a for a in argv if a in COMMAND_GROUPS or a in SINGLE_COMMANDS][:1] or None
    try:
        parser = build_parser(chosen)
    except ImportError as exc:
        print(f"gymbridge: cannot load command group {chosen}: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    return run_command(args, prog="gymbridge", log_level=args.log_level)


if __name__ == "__main__":
    sys.exit(main())
