"""Fixtures for the generation tests: the tiny generator (built once per session)."""

from __future__ import annotations

from typing import Any

import pytest

from gymbridge.generation.hf import HFGenerator


@pytest.fixture(scope="session")
def tiny_gen() -> HFGenerator:
    return HFGenerator.tiny(0)


@pytest.fixture(scope="session")
def tiny(tiny_gen: HFGenerator) -> Any:
    from gymbridge.testing.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(0)
