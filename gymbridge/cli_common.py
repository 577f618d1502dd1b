"""What every command group shares, below all of them: the exit-code rule, ``--host`` / ``--port``,
and the example environments' loader.

The ``gymbridge`` entry point (:mod:`gymbridge.cli`) sits on top of every package; its command
groups (``model``: :mod:`gymbridge.generation.cli`, ``agent``: :mod:`gymbridge.server.cli`,
``smoke`` / ``train``: :mod:`gymbridge.run.cli`) and their stand-alone entries
(``python -m gymbridge.server``) import these instead, so no lower package imports the top.

Invariants: :func:`run_command` is the one place a library error
(:class:`~gymbridge.errors.GymbridgeError`) becomes exit code 2 and one readable line on stderr,
never a traceback; every ``--port`` is parsed by :func:`port_number` (``0..MAX_PORT``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gymbridge.errors import ConfigError, GymbridgeError
from gymbridge.serving import MAX_PORT

if TYPE_CHECKING:
    from types import ModuleType

__all__ = [
    "DEFAULT_AGENT_PORT",
    "DEFAULT_ENV_PORT",
    "DEFAULT_MODEL_PORT",
    "EXAMPLES_PACKAGE",
    "add_address_arguments",
    "load_example_environments",
    "port_number",
    "run_command",
]

EXAMPLES_PACKAGE = "gymbridge_envs"
"""The installed name of the example environments (the repository folder ``environments/``).

Not ``environments``: nemo-gym owns that top-level package, and both must install in one venv."""


def load_example_environments() -> ModuleType:
    """The example environments package (:data:`EXAMPLES_PACKAGE`), installed or from a checkout.

    ``pip install gymbridge`` (or ``-e .``) installs the repository's ``environments/`` folder as
    ``gymbridge_envs``; without an install, the folder beside this checkout is loaded under
    that name. Anything else is a :class:`~gymbridge.errors.ConfigError` saying how to get it.
    """
    try:
        return importlib.import_module(EXAMPLES_PACKAGE)
    except ModuleNotFoundError as exc:
        if exc.name != EXAMPLES_PACKAGE:
            raise
    folder = Path(__file__).resolve().parent.parent / "environments"
    init = folder / "__init__.py"
    if (folder / "registry.py").is_file() and init.is_file():
        spec = importlib.util.spec_from_file_location(
            EXAMPLES_PACKAGE, init, submodule_search_locations=[str(folder)]
        )
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules[EXAMPLES_PACKAGE] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[EXAMPLES_PACKAGE]
                raise
            return module
    raise ConfigError(
        [
            f"the example environments ({EXAMPLES_PACKAGE}) are not importable: install gymbridge "
            "(pip install gymbridge, or pip install -e . in a checkout)"
        ]
    )


DEFAULT_MODEL_PORT = 8000
DEFAULT_ENV_PORT = 8001
DEFAULT_AGENT_PORT = 8002
"""Default ports of ``model serve``, ``env serve`` and ``agent serve``: distinct, so the three
servers of one stack start on one machine with no flags."""


def add_address_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    """``--host`` and ``--port`` of a serving command (``env``, ``model`` and ``agent serve``)."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=port_number,
        default=default_port,
        help=f"port, 0 for a free one (default {default_port}; model / env / agent serve default to "
        f"{DEFAULT_MODEL_PORT} / {DEFAULT_ENV_PORT} / {DEFAULT_AGENT_PORT})",
    )


def port_number(text: str) -> int:
    """argparse type of every ``--port``: an int in ``0..MAX_PORT`` (0 picks a free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(
            f"port {port} is out of range: give 0..{MAX_PORT} (0 picks a free one)"
        )
    return port


def run_command(args: argparse.Namespace, *, prog: str, log_level: str) -> int:
    """Run the ``func`` a subcommand set on ``args`` and return the exit code.

    The one place every entry point (``gymbridge``,
    ``python -m gymbridge.generation.cli``) turns errors into exit codes: a library error is
    exit 2 with one ``<prog>: error: ...`` line on stderr, Ctrl-C is 130, never a traceback.
    """
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args))
    except GymbridgeError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
