"""Fixtures for the bridge tests: the tiny VLM, its media processor, the example environments."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gymbridge.tensors import MediaProcessor
from gymbridge.testing.tiny_vlm import TinyVLM, build_tiny_vlm

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the example environments live at the repository root
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def tiny() -> TinyVLM:
    return build_tiny_vlm(0)


@pytest.fixture
def processor(tiny: TinyVLM) -> MediaProcessor:
    return MediaProcessor(tiny.processor)
