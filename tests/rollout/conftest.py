"""Fixtures for the native-rollout tests: the tiny generator and the zoom_read environment."""

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

from gymbridge.generation.hf import HFGenerator  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gen() -> HFGenerator:
    return HFGenerator.tiny(0)


@pytest.fixture(scope="session")
def tiny(tiny_gen: HFGenerator) -> Any:
    from gymbridge.testing.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(0)


@pytest.fixture
def zoom_row() -> dict[str, Any]:
    from environments.registry import get_env

    return get_env("zoom_read").make_row(0, 0, canvas_size=256, thumb_size=56, zoom_size=56)


@pytest.fixture
async def zoom_env() -> AsyncIterator[str]:
    from environments.registry import get_env
    from gymbridge.server import start_server

    async with await start_server(get_env("zoom_read").make_server()) as running:
        yield running.url
