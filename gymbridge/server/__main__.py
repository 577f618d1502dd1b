"""``python -m gymbridge.server agent ...``: the same command as ``gymbridge agent serve``.

Kept for scripts written against it; the flags, help texts and errors are those of
:mod:`gymbridge.server.cli` (one ``error:`` line and exit code 2 for a bad flag or port).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gymbridge.server.cli import add_agent_arguments


def main(argv: Sequence[str] | None = None) -> int:
    from gymbridge.cli_common import run_command

    parser = argparse.ArgumentParser(prog="python -m gymbridge.server", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_agent_arguments(sub.add_parser("agent", help="serve the SimpleAgent (POST /run)"))
    args = parser.parse_args(argv)
    return run_command(args, prog="gymbridge agent", log_level="INFO")


if __name__ == "__main__":
    sys.exit(main())
