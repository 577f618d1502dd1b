"""Thin script over the smoke launcher: ``python examples/smoke.py [--native] [--steps N] ...``.

Same options as ``gymbridge smoke`` (see ``gymbridge/launch/smoke.py``); defaults come from
``configs/smoke.yaml``. Everything runs on 127.0.0.1 and every server is stopped at the end.
"""

from __future__ import annotations

import sys

from gymbridge.launch.smoke import main

if __name__ == "__main__":
    sys.exit(main())
