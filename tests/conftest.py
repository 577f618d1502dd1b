"""Shared pytest setup: test tiers and their skip helpers.

Tiers (markers): the default run is unit + in-process integration on CPU.
``slow`` and ``gpu`` are opt-in (``-m slow`` / ``-m gpu``); a ``gpu`` test run
on a machine without CUDA is skipped with a reason instead of failing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.testing.tiny_omni import TinyOmni
    from gymbridge.testing.tiny_vlm import TinyVLM

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny() -> TinyVLM:
    """The tiny offline Qwen2-VL (random weights, seed 0), built once per session."""
    from gymbridge.testing.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(0)


@pytest.fixture(scope="session")
def tiny_gen() -> HFGenerator:
    """An ``HFGenerator`` over the tiny model (seed 0), built once per session."""
    from gymbridge.generation.hf import HFGenerator

    return HFGenerator.tiny(0)


@pytest.fixture(scope="session")
def tiny_omni() -> TinyOmni:
    """The tiny offline Qwen2.5-Omni thinker (image, video, audio; random weights, seed 0), built once."""
    from gymbridge.testing.tiny_omni import build_tiny_omni

    return build_tiny_omni(0)


@pytest.fixture(scope="session")
def tiny_omni_gen() -> HFGenerator:
    """An ``HFGenerator`` over the tiny omni model (seed 0), built once per session."""
    from gymbridge.generation.hf import HFGenerator

    return HFGenerator.tiny_omni(0)


def _gym_wheel_data() -> tuple[Path | None, str]:
    """Where the genuine nemo-gym 0.7.0 data files are: the conformance venv's site-packages.

    ``GYMBRIDGE_NEMO_GYM_SRC`` (an unpacked wheel or a checkout) wins when set. Returns the
    folder, or ``None`` and the reason it is missing.
    """
    explicit = os.environ.get("GYMBRIDGE_NEMO_GYM_SRC")
    if explicit:
        path = Path(explicit)
        return (path, "") if path.is_dir() else (None, f"GYMBRIDGE_NEMO_GYM_SRC={explicit} is not a folder")
    venv = Path(os.environ.get("GYM_VENV", Path(__file__).resolve().parents[1] / ".venv-gym"))
    found = sorted(venv.glob("lib/python3*/site-packages/resources_servers"))
    if found:
        return found[0].parent, ""
    return None, f"genuine nemo-gym 0.7.0 data not found: {venv} has no site-packages/resources_servers " + (
        "(run `bash scripts/setup_gym_venv.sh`)"
    )


@pytest.fixture(scope="session")
def gym_wheel_data() -> Path:
    """The genuine nemo-gym 0.7.0 wheel's files (``resources_servers/``, ``environments/``, ...).

    Skips with the reason when absent; under ``GYMBRIDGE_REQUIRE_GYM=1`` (CI) that is a failure.
    """
    path, reason = _gym_wheel_data()
    if path is None:
        if os.environ.get("GYMBRIDGE_REQUIRE_GYM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path
