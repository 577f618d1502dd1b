"""The ``peers`` suite: gymbridge's objective side by side with verl's and TRL's own functions.

Every test here is marked ``peers``. The folder is skipped with a reason naming the fix (and the
last failure of ``scripts/setup_peers_venv.sh``, if any) when ``.venv-peers`` is absent;
``GYMBRIDGE_REQUIRE_PEERS=1`` turns that skip into a failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _peers import REQUIRE_PEERS, peers_venv_problem


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    problem = peers_venv_problem()
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.peers)
            if problem and not REQUIRE_PEERS:
                item.add_marker(pytest.mark.skip(reason=f"peers suite skipped: {problem}"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """With GYMBRIDGE_REQUIRE_PEERS=1, an unusable peers venv fails each test before it runs."""
    if not REQUIRE_PEERS or Path(__file__).parent not in Path(str(item.fspath)).parents:
        return
    problem = peers_venv_problem()
    if problem:
        pytest.fail(f"GYMBRIDGE_REQUIRE_PEERS=1 but the peers suite cannot run: {problem}", pytrace=False)
