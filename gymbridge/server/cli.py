"""``gymbridge agent serve``: run the :class:`~gymbridge.server.SimpleAgent` as a server.

::

    gymbridge agent serve --resources-url http://127.0.0.1:8001 --model-url http://127.0.0.1:8000 \\
        [--port 8002] [--gymnasium] [--max-steps 8] [--rollout-prefix]

:func:`add_agent_commands` adds the ``agent`` group's subcommand to an ``argparse``
sub-parser (the CLI's dispatch table points at it); ``python -m gymbridge.server agent ...``
(:mod:`gymbridge.server.__main__`) takes the same flags. Like every gymbridge server, the agent
binds its port before it prints its one ``serving ... on URL`` line; a bad port or URL is one
``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from urllib.parse import urlsplit

from gymbridge.errors import ConfigError

__all__ = ["add_agent_arguments", "add_agent_commands", "run_agent"]


def _url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {text!r} (e.g. http://127.0.0.1:8001)")
    return text


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent's flags, each with help text (shared by ``gymbridge agent serve`` and ``python -m``)."""
    from gymbridge.cli_common import DEFAULT_AGENT_PORT, add_address_arguments

    parser.add_argument(
        "--resources-url", type=_url, required=True, help="base URL of the environment (resources server)"
    )
    parser.add_argument("--model-url", type=_url, required=True, help="base URL of the model server")
    add_address_arguments(parser, DEFAULT_AGENT_PORT)
    parser.add_argument(
        "--name", default="simple_agent", help="instance name (session cookie SimpleAgent___<name>)"
    )
    parser.add_argument(
        "--max-steps", type=int, default=8, help="model calls per rollout before it stops (default 8)"
    )
    parser.add_argument(
        "--gymnasium", action="store_true", help="drive a gymnasium-style environment (/reset, /step)"
    )
    parser.add_argument(
        "--model-timeout-s", type=_positive_seconds, default=600.0, help="deadline of one model call (600)"
    )
    parser.add_argument(
        "--tool-timeout-s", type=_positive_seconds, default=120.0, help="deadline of one tool call (120)"
    )
    parser.add_argument(
        "--env-timeout-s",
        type=_positive_seconds,
        default=120.0,
        help="deadline of one seed/verify/reset/step call (120)",
    )
    parser.add_argument(
        "--tool-media",
        choices=["user_message", "output"],
        default="user_message",
        help="where a tool's images go: an injected user message (stock Gym) or the tool output",
    )
    parser.add_argument(
        "--rollout-prefix",
        action="store_true",
        help="send /ng-rollout/<id> (from the row's _ng_* keys) on every outbound call, as stock Gym "
        "does with observability on",
    )
    parser.add_argument(
        "--media-store-url",
        type=_url,
        default=None,
        help="base URL of a gymbridge media server: inline media are stored there once and replayed "
        "to the model as references (default: media stay inline)",
    )
    parser.set_defaults(func=run_agent)


def add_agent_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``agent serve``."""
    p = sub.add_parser(
        "serve",
        help="serve the simple agent (POST /run) in front of an environment and a model server",
        description="Serve gymbridge's SimpleAgent: POST /run drives one rollout, returns the verify result.",
    )
    add_agent_arguments(p)


def run_agent(args: argparse.Namespace) -> int:
    """Build the agent from parsed flags and serve it until SIGINT / SIGTERM."""
    from gymbridge.server._agent import SimpleAgent
    from gymbridge.server._base import serve

    if args.max_steps < 1:
        raise ConfigError([f"--max-steps must be >= 1, got {args.max_steps}"])
    server = SimpleAgent(
        resources_url=args.resources_url,
        model_url=args.model_url,
        max_steps=args.max_steps,
        gymnasium=args.gymnasium,
        model_timeout_s=args.model_timeout_s,
        tool_timeout_s=args.tool_timeout_s,
        env_timeout_s=args.env_timeout_s,
        tool_media=args.tool_media,
        instance_name=args.name,
        rollout_prefix=args.rollout_prefix,
        media_store_url=args.media_store_url,
    )

    def announce(url: str) -> None:
        print(f"serving agent {args.name} on {url} (Ctrl-C to stop)", file=sys.stderr, flush=True)

    serve(server, host=args.host, port=args.port, announce=announce)
    return 0
