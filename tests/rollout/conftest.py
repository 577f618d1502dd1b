"""Fixtures for the native-rollout tests: the zoom_read environment (tiny generator: tests/conftest.py)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "tests" / "generation"):  # example environments; shared test helpers
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))


@pytest.fixture
def zoom_row() -> dict[str, Any]:
    from gymbridge_envs.registry import get_env

    return get_env("zoom_read").make_row(0, 0, canvas_size=256, thumb_size=56, zoom_size=56)


@pytest.fixture
async def zoom_env() -> AsyncIterator[str]:
    from gymbridge.server import start_server
    from gymbridge_envs.registry import get_env

    async with await start_server(get_env("zoom_read").make_server()) as running:
        yield running.url
