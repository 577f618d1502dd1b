"""The flat public API: sorted, every name resolves, and ``import gymbridge`` stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import gymbridge


def test_all_is_sorted_and_unique() -> None:
    assert gymbridge.__all__ == sorted(set(gymbridge.__all__))
    assert set(gymbridge.__all__) == set(gymbridge._EXPORTS)


def test_every_exported_name_resolves_to_its_subpackage_object() -> None:
    import importlib

    for name in gymbridge.__all__:
        obj = getattr(gymbridge, name)
        module = gymbridge._EXPORTS[name]
        assert obj is getattr(importlib.import_module(module), name), name
        assert name in importlib.import_module(module).__all__, f"{name} not in {module}.__all__"


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = gymbridge.NoSuchThing  # type: ignore[attr-defined]


def test_import_gymbridge_does_not_import_torch() -> None:
    code = "import sys, gymbridge; gymbridge.GymbridgeError; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_flat_namespace_exports_the_loop_pieces() -> None:
    """The README's loop (rollout sources -> BridgeIterator -> GRPOTrainer) imports from ``gymbridge``."""
    import gymbridge
    from gymbridge.bridge import BridgeIterator, GymRollouts, NativeRollouts
    from gymbridge.trainer import GRPOConfig, GRPOTrainer

    for obj in (BridgeIterator, GymRollouts, NativeRollouts, GRPOConfig, GRPOTrainer):
        assert getattr(gymbridge, obj.__name__) is obj and obj.__name__ in gymbridge.__all__
