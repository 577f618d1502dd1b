"""Installs as users make them: a base install without torch, and gymbridge beside nemo-gym 0.7.0.

* ``test_base_modules_import_without_torch``: in this venv, with torch / transformers /
  tokenizers made unimportable, the base modules (protocol, media, server SDK, agent, client,
  check_env, the CLI and every example environment) import: nothing there needs torch at
  import time (seconds).
* ``test_torch_free_venv_serves_checks_and_drives_an_environment``: a fresh venv gets
  ``pip install <checkout>`` (the base install, not editable, so the wheel's package list is
  what is tested) and, in it, the shipped configs and viewer template are package data,
  ``drive_env.py`` serves ``counter`` through the CLI, passes
  ``check_env`` and solves three rows through the agent and a scripted model; torch is absent
  from the venv (about 40 s with a warm pip cache). On the locked set-up (``scripts/test.sh``
  exports ``GYMBRIDGE_TEST_CONSTRAINTS``, requirements-test.txt) the install takes the lock's
  versions; on ``GYMBRIDGE_DEPS=latest`` the newest ones, as a user's ``pip install`` would.
* ``test_regression_environments_package_collides_with_nemo_gym``: one venv holding nemo-gym
  0.7.0 (the conformance venv's packages, through a ``.pth`` file) and ``pip install
  <checkout>``: ``gymbridge env list`` works, nemo-gym's own top-level ``environments``
  package is still nemo-gym's, and ``pip check`` is clean (about 20 s); on the locked set-up what
  the conformance venv lacks installs at the lock's versions. Needs ``.venv-gym``:
  skipped with the reason when it is absent, a failure under ``GYMBRIDGE_REQUIRE_GYM=1`` (CI).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
GYM_VENV = Path(os.environ.get("GYM_VENV", REPO / ".venv-gym"))
REQUIRE_GYM = os.environ.get("GYMBRIDGE_REQUIRE_GYM") == "1"
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)
PIP = ["-m", "pip", "install", "-q", "--disable-pip-version-check"]
CONSTRAINTS = os.environ.get("GYMBRIDGE_TEST_CONSTRAINTS")  # the lock, on the locked set-up

BLOCK_TORCH = """
import importlib, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "tokenizers"):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
import gymbridge_envs
modules = ["gymbridge", "gymbridge.protocol", "gymbridge.media", "gymbridge.server", "gymbridge.client",
           "gymbridge.trajectory", "gymbridge.config", "gymbridge.cli", "gymbridge.server.cli",
           "gymbridge.testing.scripted_model", "gymbridge_envs.registry", "gymbridge_envs._testing"]
envs = [s.name for s in gymbridge_envs.list_envs()]
modules += [f"gymbridge_envs.{e}.{part}" for e in envs for part in ("data", "server")]
for name in modules:
    importlib.import_module(name)
from gymbridge.server import check_env, SimpleAgent, ResourcesServer  # noqa: F401
print(len(modules))
"""

SHIPPED_DATA = """
import json, pathlib, gymbridge
from gymbridge.config import read_config
root = pathlib.Path(gymbridge.__file__).parent
assert "site-packages" in str(root), root  # the installed copy, not the checkout
print(json.dumps({"configs": sorted(p.name for p in (root / "configs").glob("*.yaml")),
                  "default_env": read_config(root / "configs" / "smoke.yaml")["env"]["name"],
                  "viewer": (root / "run" / "viewer.html").is_file()}))
"""


def _run(argv: list[str], *, cwd: Path, timeout: float = 300, check: bool = True) -> str:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout to ``pip install`` from (an in-tree build would write build/ here)."""
    heavy = shutil.ignore_patterns(".venv*", ".git", "build", "*.egg-info", "__pycache__", ".*_cache", "runs")
    target = tmp_path_factory.mktemp("src") / "gymbridge"
    shutil.copytree(REPO, target, ignore=heavy)
    return target


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _new_venv(where: Path) -> Path:
    _run([BASE_PYTHON, "-m", "venv", str(where)], cwd=where.parent)
    return where / "bin" / "python"


def test_base_modules_import_without_torch(tmp_path: Path) -> None:
    out = _run([sys.executable, "-c", BLOCK_TORCH], cwd=tmp_path)
    assert int(out.strip()) > 20


def test_torch_free_venv_serves_checks_and_drives_an_environment(tmp_path: Path, source_tree: Path) -> None:
    started = time.perf_counter()
    python = _new_venv(tmp_path / "venv")
    _run([str(python), *PIP, *(["-c", CONSTRAINTS] if CONSTRAINTS else []), str(source_tree)], cwd=tmp_path)
    built_s = time.perf_counter() - started
    probe = _run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('torch') is None)"], cwd=tmp_path
    )
    assert probe.strip() == "True", "the base install pulled torch in"
    # the configs and the viewer template ship inside the installed package (package data)
    shipped = _run([str(python), "-c", SHIPPED_DATA], cwd=tmp_path).splitlines()[-1]
    assert json.loads(shipped) == {
        "configs": sorted(p.name for p in (REPO / "gymbridge" / "configs").glob("*.yaml")),
        "default_env": "color_pick",
        "viewer": True,
    }
    # the CLI's torch-free commands work too
    listing = _run([str(python.with_name("gymbridge")), "env", "list", "--params"], cwd=tmp_path)
    assert "counter" in listing
    seen = json.loads(
        _run([str(python), str(HERE / "drive_env.py"), "counter"], cwd=tmp_path).splitlines()[-1]
    )
    assert seen["check_env_ok"] is True
    assert seen["rewards"] == [1.0, 1.0, 1.0]
    assert seen["torch_imported"] is False and seen["transformers_imported"] is False
    print(f"torch-free venv built in {built_s:.1f} s, whole test {time.perf_counter() - started:.1f} s")


def _gym_site_packages() -> Path | None:
    """The conformance venv's site-packages, when that venv was built completely."""
    if not (GYM_VENV / ".gymbridge-gym-stamp").exists():
        return None
    found = sorted(GYM_VENV.glob("lib/python3*/site-packages/nemo_gym"))
    return found[0].parent if found else None


@pytest.mark.gym
def test_regression_environments_package_collides_with_nemo_gym(tmp_path: Path, source_tree: Path) -> None:
    """Both installed in one venv used to share ``environments/`` files, and ``gymbridge env list``
    crashed (``module 'environments' has no attribute 'list_envs'``)."""
    gym_site = _gym_site_packages()
    if gym_site is None:
        message = f"{GYM_VENV} (genuine nemo-gym 0.7.0) is absent: run `bash scripts/setup_gym_venv.sh`"
        if REQUIRE_GYM:
            pytest.fail(message)
        pytest.skip(message)
    started = time.perf_counter()
    python = _new_venv(tmp_path / "combined")
    purelib = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path
        ).strip()
    )
    # nemo-gym 0.7.0 and its pinned dependencies, as installed in the conformance venv
    (purelib / "nemo_gym_venv.pth").write_text(f"{gym_site}\n")
    constraints: list[str] = []
    if CONSTRAINTS:  # the lock's versions for what the conformance venv lacks; its own pins stay
        have = {_normal(d.metadata["Name"]) for d in metadata.distributions(path=[str(gym_site)])}
        lines = [ln for ln in Path(CONSTRAINTS).read_text().splitlines() if "==" in ln]
        rest = tmp_path / "constraints.txt"
        rest.write_text("".join(f"{ln}\n" for ln in lines if _normal(ln.split("==")[0]) not in have))
        constraints = ["-c", str(rest)]
    _run([str(python), *PIP, *constraints, str(source_tree)], cwd=tmp_path)
    built_s = time.perf_counter() - started
    listing = _run([str(python.with_name("gymbridge")), "env", "list"], cwd=tmp_path)
    assert "circle_click" in listing and "grid_door" in listing
    both = _run(
        [
            str(python),
            "-c",
            "import environments, nemo_gym, gymbridge_envs, gymbridge.server, importlib.metadata as m;"
            "import environments.hermes_math;"
            "print(environments.__file__); print(gymbridge_envs.__file__); print(m.version('nemo-gym'))",
        ],
        cwd=tmp_path,
    ).split()
    assert both[0] == str(gym_site / "environments" / "__init__.py"), both  # still nemo-gym's
    assert both[1].startswith(str(purelib / "gymbridge_envs")), both
    assert both[2] == "0.7.0"
    assert not (gym_site / "environments" / "registry.py").exists(), "gymbridge files in nemo-gym's package"
    pip_check = subprocess.run(
        [str(python), "-m", "pip", "check"], capture_output=True, text=True, cwd=tmp_path
    )
    assert pip_check.returncode == 0, pip_check.stdout
    print(f"combined venv built in {built_s:.1f} s, whole test {time.perf_counter() - started:.1f} s")
