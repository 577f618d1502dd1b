"""``python -m gymbridge.server agent ...``: run the SimpleAgent as a standalone server.

Lets genuine NeMo Gym clients (or gymbridge's) drive a resources server and a model
server through our agent from another process::

    python -m gymbridge.server agent --resources-url http://127.0.0.1:8001 \\
        --model-url http://127.0.0.1:8002 --port 8003 [--gymnasium] [--max-steps 8] [--rollout-prefix]
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from gymbridge.server._agent import SimpleAgent
from gymbridge.server._base import serve


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gymbridge.server", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    agent = sub.add_parser("agent", help="serve the SimpleAgent (POST /run)")
    agent.add_argument("--resources-url", required=True)
    agent.add_argument("--model-url", required=True)
    agent.add_argument("--host", default="127.0.0.1")
    agent.add_argument("--port", type=int, required=True)
    agent.add_argument("--name", default="simple_agent", help="instance name (cookie: SimpleAgent___<name>)")
    agent.add_argument("--max-steps", type=int, default=8)
    agent.add_argument("--gymnasium", action="store_true", help="drive a reset/step environment")
    agent.add_argument("--model-timeout-s", type=float, default=600.0)
    agent.add_argument("--tool-timeout-s", type=float, default=120.0)
    agent.add_argument("--env-timeout-s", type=float, default=120.0)
    agent.add_argument("--tool-media", choices=["user_message", "output"], default="user_message")
    agent.add_argument(
        "--rollout-prefix",
        action="store_true",
        help="send /ng-rollout/<id> (from the row's _ng_* keys) on every outbound call, as stock Gym "
        "does with observability on",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    )
    serve(server, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
