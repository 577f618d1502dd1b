"""The ``peers`` suite: gymbridge's objective side by side with verl's and TRL's own functions.

Every test here is marked ``peers`` and runs the peers in ``.venv-verl`` (the root conftest's
``verl_python``: skipped with the fix named when that venv is unusable, a failure under
``GYMBRIDGE_REQUIRE_VERL=1``). scripts/test.sh runs the folder after ``.venv-verl`` is built.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.peers)
