"""The ``vllm`` conformance suite: gymbridge's vLLM backend against the real vLLM in ``.venv-vllm``.

Every test here is marked ``vllm`` and runs a script of ``scripts/`` inside the vLLM venv
(``_vllm_venv.run_script``): vLLM is only imported there (no GPU), its serialisation, input
processors, scheduler and model classes run on CPU. The folder is skipped with a reason naming the
fix (and the last failure of ``scripts/setup_vllm_venv.sh``) when the venv is absent;
``GYMBRIDGE_REQUIRE_VLLM=1`` (CI) turns that skip into a failure. Modules that set
``NEEDS_VLLM_VENV = False`` (checks of the set-up script itself) run either way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _vllm_venv import REQUIRE_VLLM, vllm_venv_problem


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    problem = vllm_venv_problem()
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            if getattr(item.module, "NEEDS_VLLM_VENV", True) is False:
                continue  # checks of the set-up itself run either way
            if problem and not REQUIRE_VLLM:
                item.add_marker(pytest.mark.skip(reason=f"vllm suite skipped: {problem}"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """With GYMBRIDGE_REQUIRE_VLLM=1, an unusable vLLM venv fails each test before it runs."""
    if not REQUIRE_VLLM or Path(__file__).parent not in Path(str(item.fspath)).parents:
        return
    if getattr(getattr(item, "module", None), "NEEDS_VLLM_VENV", True) is False:
        return
    problem = vllm_venv_problem()
    if problem:
        pytest.fail(f"GYMBRIDGE_REQUIRE_VLLM=1 but the vllm suite cannot run: {problem}", pytrace=False)
