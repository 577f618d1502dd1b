"""Fixtures for the bridge tests: the tiny VLM's media processor (the model itself: tests/conftest.py)."""

from __future__ import annotations

import pytest

from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.tensors import MediaProcessor


@pytest.fixture
def processor(tiny: TinyVLM) -> MediaProcessor:
    return MediaProcessor(tiny.processor)
