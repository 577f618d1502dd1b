"""The locked test set-up: requirements-test.txt agrees with pyproject.toml and is what .venv holds.

* every requirement of the base install and of the extras ``scripts/test.sh`` installs
  (``scripts/deps.sh``) is met by the lock's pin: a widened or narrowed range in pyproject.toml
  without ``bash scripts/lock.sh`` fails here, not on a fresh machine;
* the lock pins the CPU torch release without a local label, and leaves pip and wheel out;
* on the locked set-up (``scripts/test.sh`` exports ``GYMBRIDGE_TEST_CONSTRAINTS``) every locked
  package this venv holds has the lock's version: the suite ran on the lock, not on what PyPI
  served that day;
* ``scripts/lock_diff.py`` (the newest-releases run's report) names every changed, new and gone package.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from lock_diff import differences, pins  # noqa: E402


def _deps_sh() -> dict[str, str]:
    text = (REPO / "scripts" / "deps.sh").read_text()
    return dict(re.findall(r'^([A-Z_]+)="([^"]*)"$', text, flags=re.M))


DEPS = _deps_sh()
LOCK = REPO / DEPS["TEST_LOCK"]


def _locked() -> dict[str, str]:
    return pins(LOCK.read_text().splitlines())


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_requirement_of_the_test_install_is_met_by_the_lock() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = DEPS["TEST_EXTRAS"].split(",")
    wanted = [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e])]
    locked = _locked()
    unmet = []
    for line in wanted:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"python_version": "3.11"}):
            continue
        version = locked.get(_normal(req.name))
        if version is None or not req.specifier.contains(Version(version), prereleases=True):
            unmet.append(f"{line} (lock: {version})")
    assert unmet == [], f"pyproject.toml and {LOCK.name} disagree; run bash scripts/lock.sh: {unmet}"


def test_the_lock_pins_the_cpu_torch_and_no_installer_tools() -> None:
    text = LOCK.read_text()
    assert f"\n{DEPS['TORCH_CPU']}\n" in text
    assert "+" not in "".join(line for line in text.splitlines() if not line.startswith("#"))
    assert not {"pip", "wheel", "gymbridge"} & _locked().keys()


@pytest.mark.skipif(
    not os.environ.get("GYMBRIDGE_TEST_CONSTRAINTS"),
    reason="not the locked set-up (scripts/test.sh sets GYMBRIDGE_TEST_CONSTRAINTS)",
)
def test_this_venv_holds_the_locked_versions() -> None:
    installed = {_normal(d.metadata["Name"]): d.version.split("+", 1)[0] for d in metadata.distributions()}
    off = {
        name: (version, installed[name])
        for name, version in _locked().items()
        if name in installed and installed[name] != version and name != "torch"  # a kept torch is allowed
    }
    assert off == {}, f"installed versions differ from {LOCK.name}: {off}"
    missing = sorted(n for n in ("transformers", "trl", "mypy", "ruff", "pytest") if n not in installed)
    assert missing == []


def test_lock_diff_names_changed_new_and_gone_packages() -> None:
    locked = pins(["# a comment", "Foo_Bar==1.0", "torch==2.13.0", "gone==3"])
    now = pins(["foo-bar==1.1", "torch==2.13.0+cpu", "fresh==0.1"])
    assert differences(locked, now) == ["foo-bar 1.0 -> 1.1", "fresh (new) 0.1", "gone 3 (gone)"]
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "lock_diff.py"), str(LOCK)],
        input=LOCK.read_text(), capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert out.strip().endswith(f"0 package(s) differ from {LOCK.name}")
