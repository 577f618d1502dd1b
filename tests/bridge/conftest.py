"""Fixtures for the bridge tests: the tiny VLM's media processor (the model itself: tests/conftest.py)."""

from __future__ import annotations

import pytest

from gymbridge.tensors import MediaProcessor
from gymbridge.testing.tiny_vlm import TinyVLM


@pytest.fixture
def processor(tiny: TinyVLM) -> MediaProcessor:
    return MediaProcessor(tiny.processor)
