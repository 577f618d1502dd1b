"""Shared pytest setup: test tiers and their skip helpers.

Tiers (markers): the default run is unit + in-process integration on CPU.
``slow`` and ``gpu`` are opt-in (``-m slow`` / ``-m gpu``); a ``gpu`` test run
on a machine without CUDA is skipped with a reason instead of failing.

Parallel runs (``scripts/test.sh`` runs the default tier with ``pytest -n <CPUs, at most 4>
--dist loadfile --no-loadscope-reorder``, pytest-xdist): each test file stays on one worker
(module fixtures start once), tests use ``tmp_path`` and free ports, and each worker's torch
(and every process a test starts) uses one thread (``OMP_NUM_THREADS=1``) so the workers do not
oversubscribe the cores. In a worker the files measured slowest are collected first (``HEAVY_FIRST``; the
``--no-loadscope-reorder`` keeps that order instead of xdist's most-tests-first), so no long file
starts last and leaves one worker idle; the order changes scheduling only, never what a test
checks.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

if TYPE_CHECKING:
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.models.tiny_omni import TinyOmni
    from gymbridge.models.tiny_vlm import TinyVLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# no per-example time limit (hypothesis's default is 200 ms): a loaded machine must not fail a
# property; tests/test_no_time_budgets.py checks it is loaded
settings.register_profile("gymbridge", deadline=None)
settings.load_profile("gymbridge")
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")


def _unshadow_vllm() -> None:
    """Keep ``tests/vllm`` from passing for an installed vLLM.

    pytest puts ``tests/`` on ``sys.path`` (this conftest, prepend import mode), where the
    ``tests/vllm`` folder is importable as a namespace package ``vllm``: TRL then believes vLLM is
    installed and fails to import (``Version('N/A')``), and ``import vllm`` succeeds without vLLM.
    Marking the name absent makes both see what is installed (nothing, in ``.venv``).
    """
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return
    here = Path(__file__).resolve().parent / "vllm"
    locations = spec.submodule_search_locations if spec is not None and spec.loader is None else None
    if locations is not None and all(Path(location).resolve() == here for location in locations):
        sys.modules["vllm"] = None


_unshadow_vllm()
if XDIST_WORKER:  # read by torch at import and inherited by the processes tests start
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Slowest files first under xdist (per-file seconds from `pytest -n 2 --dist loadfile
# --durations=0`, heaviest first); a file missing here keeps its collection order after these.
HEAVY_FIRST = (
    "tests/run/test_resume_kill.py",
    "tests/run/test_run_e2e.py",
    "tests/packaging/test_packaging.py",
    "tests/run/test_shipped_configs_train.py",
    "tests/integrations/test_trl_train.py",
    "tests/integrations/test_verl_agent_loop.py",
    "tests/gym/test_trl_genuine_agent.py",
    "tests/trainer/test_ray_dp.py",
    "tests/run/test_rundir_resume.py",
    "tests/run/test_run_placement.py",
    "tests/gym/test_gym_collector.py",
    "tests/trainer/test_packing.py",
    "tests/test_cli_first_hour.py",
    "tests/trainer/test_grpo_variants.py",
    "tests/run/test_run_dp.py",
    "tests/trainer/test_weight_sync_process.py",
    "tests/generation/test_gen_server.py",
    "tests/generation/test_gen_server_hardening.py",
    "tests/trainer/test_encoder_dedup.py",
)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return bool(torch.cuda.is_available())


def _heavy_rank(item: pytest.Item, root: Path) -> int:
    try:
        rel = Path(str(item.fspath)).resolve().relative_to(root).as_posix()
    except ValueError:
        return len(HEAVY_FIRST)
    return HEAVY_FIRST.index(rel) if rel in HEAVY_FIRST else len(HEAVY_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if XDIST_WORKER:  # stable: within a file, and among the unlisted files, the order is kept
        root = Path(__file__).resolve().parents[1]
        items.sort(key=lambda item: _heavy_rank(item, root))
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny() -> TinyVLM:
    """The tiny offline Qwen2-VL (random weights, seed 0), built once per session."""
    from gymbridge.models.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(0)


@pytest.fixture(scope="session")
def tiny_gen() -> HFGenerator:
    """An ``HFGenerator`` over the tiny model (seed 0), built once per session."""
    from gymbridge.generation.hf import HFGenerator

    return HFGenerator.tiny(0)


@pytest.fixture(scope="session")
def tiny_omni() -> TinyOmni:
    """The tiny offline Qwen2.5-Omni thinker (image, video, audio; random weights, seed 0), built once."""
    from gymbridge.models.tiny_omni import build_tiny_omni

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


VERL_STAMP_SUFFIX = "verl==0.9.1 trl==1.16.0"
"""What scripts/setup_verl_venv.sh's stamp ends with once the venv holds both (tests/peers needs TRL)."""


def verl_venv_problem(venv: Path | None = None) -> str | None:
    """Why ``.venv-verl`` (verl 0.9.1 + gymbridge: ``scripts/setup_verl_venv.sh``) is unusable, or ``None``.

    ``VERL_VENV`` overrides the folder; the last failure the setup script recorded
    (``.cache/verl-setup-failed``) is quoted, so a skipped verl test says why.
    """
    root = Path(__file__).resolve().parents[1]
    venv = venv or Path(os.environ.get("VERL_VENV", root / ".venv-verl"))
    stamp = venv / ".gymbridge-verl-stamp"
    problem: str | None = None
    if not (venv / "bin" / "python").exists():
        problem = f"{venv} is absent: run `bash scripts/setup_verl_venv.sh` to build the verl 0.9.1 venv"
    elif not (stamp.exists() and stamp.read_text().strip().endswith(VERL_STAMP_SUFFIX)):
        fix = "rerun `bash scripts/setup_verl_venv.sh`"
        problem = f"{venv} is incomplete (no stamp for {VERL_STAMP_SUFFIX}): {fix}"
    note = root / ".cache" / "verl-setup-failed"
    if problem and note.exists():
        problem += f"; last setup failure: {note.read_text(errors='replace').strip()[-500:]}"
    return problem


@pytest.fixture(scope="session")
def verl_python() -> Path:
    """The ``.venv-verl`` interpreter, for tests that run scripts under verl's own pins.

    Skips with the reason when the venv is unusable; under ``GYMBRIDGE_REQUIRE_VERL=1`` (CI) that is
    a failure, as ``GYMBRIDGE_REQUIRE_GYM=1`` is for the gym suite.
    """
    problem = verl_venv_problem()
    if problem is not None:
        if os.environ.get("GYMBRIDGE_REQUIRE_VERL") == "1":
            pytest.fail(f"GYMBRIDGE_REQUIRE_VERL=1 but the verl tests cannot run: {problem}", pytrace=False)
        pytest.skip(f"verl tests skipped: {problem}")
    root = Path(__file__).resolve().parents[1]
    return Path(os.environ.get("VERL_VENV", root / ".venv-verl")) / "bin" / "python"
