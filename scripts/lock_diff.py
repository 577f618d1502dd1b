"""Which installed versions differ from a lock: ``pip freeze | python scripts/lock_diff.py LOCK``.

Reads ``name==version`` lines (``pip freeze``) from standard input and the lock named on the command
line; prints one line per package whose version differs, is new, or is gone (pip and wheel, the
venv's installers, aside), then a count. Names are
compared as PEP 503 normalises them and versions without a local label (``2.13.0+cpu`` is
``2.13.0``). Used by ``GYMBRIDGE_DEPS=latest bash scripts/test.sh``; exits 0 either way.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path


def pins(lines: Iterable[str]) -> dict[str, str]:
    """``{normalised name: version}`` of the ``name==version`` lines (comments and others skipped)."""
    found: dict[str, str] = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if "==" not in line:
            continue
        name, version = line.split("==", 1)
        found[re.sub(r"[-_.]+", "-", name.strip()).lower()] = version.strip().split("+", 1)[0]
    return found


def differences(locked: dict[str, str], installed: dict[str, str]) -> list[str]:
    """One line per package: ``name lock -> installed``, ``name (new) version``, ``name version (gone)``."""
    lines = []
    for name in sorted(locked.keys() | installed.keys()):
        before, now = locked.get(name), installed.get(name)
        if before == now:
            continue
        if before is None:
            lines.append(f"{name} (new) {now}")
        elif now is None:
            lines.append(f"{name} {before} (gone)")
        else:
            lines.append(f"{name} {before} -> {now}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    tools = {"pip", "wheel"}  # the venv's own installers, never locked
    locked = {k: v for k, v in pins(Path(argv[1]).read_text().splitlines()).items() if k not in tools}
    changed = differences(locked, {k: v for k, v in pins(sys.stdin).items() if k not in tools})
    for line in changed:
        print(f"   {line}")
    print(f"   {len(changed)} package(s) differ from {Path(argv[1]).name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
