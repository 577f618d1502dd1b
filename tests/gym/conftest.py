"""Fixtures for the ``gym`` conformance suite: genuine NeMo Gym 0.7.0 servers as subprocesses.

Every test here is marked ``gym``. The whole folder is skipped with a reason naming the fix (and
the last failure of ``scripts/setup_gym_venv.sh``, if any) when ``.venv-gym`` is absent, so unit
tests run alone. ``GYMBRIDGE_REQUIRE_GYM=1`` turns that skip into a failure (for CI set-ups that
must never pass without the genuine suite). Modules that set ``NEEDS_GYM_VENV = False`` (checks of
the set-up itself) run either way. A genuine conformance regression is never a skip: gymbridge
modules are imported plainly, so a broken one fails collection instead of skipping.

Fixtures (session-scoped where a server is stateless per rollout, to keep the suite fast):

* ``script_book`` / ``scripted_model_url``: one gymbridge ``ScriptedModelServer`` in a background
  thread with its own event loop. Its script is a dispatcher: a request whose
  ``metadata.script`` is ``NAME`` gets entry ``call_index`` of the script registered as ``NAME``
  (``script_book.add(NAME, [...])``), so concurrent tests never share a script.
* ``genuine_stack``: genuine ``example_session_state_mgmt`` (``counter``) and ``circle_click``
  resources servers, each behind a genuine ``simple_agent``, all talking to the scripted model,
  plus the genuine head server (discovery).
* ``GenuineStack`` (from ``_genuine``) for tests that start their own stacks (genuine agents in
  front of our environments).

Invariants: servers bind 127.0.0.1 only; each stack is stopped by process group at teardown; a
failing test's report carries the genuine servers' log tails (``gym_logs_on_failure``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _genuine import (
    KIND_RESOURCES,
    REQUIRE_GYM,
    GenuineStack,
    gym_venv_problem,
)
from _gym_support import MODEL_NAME, ScriptBook, ThreadedLoop, add_genuine_simple_agent, add_scripted_model

from gymbridge.testing.scripted_model import ScriptedModelServer

# environments/ (our example environments) is imported by package name from the repo root.
_REPO_ROOT = str(Path(__file__).resolve().parents[2])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    problem = gym_venv_problem()
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gym)
            if not problem or getattr(item.module, "NEEDS_GYM_VENV", True) is False:
                continue
            if not REQUIRE_GYM:
                item.add_marker(pytest.mark.skip(reason=f"gym suite skipped: {problem}"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """With GYMBRIDGE_REQUIRE_GYM=1, an unusable gym venv fails each test before any fixture runs."""
    if not REQUIRE_GYM or getattr(getattr(item, "module", None), "NEEDS_GYM_VENV", True) is False:
        return
    if Path(__file__).parent not in Path(str(item.fspath)).parents:
        return
    problem = gym_venv_problem()
    if problem:
        pytest.fail(f"GYMBRIDGE_REQUIRE_GYM=1 but the gym suite cannot run: {problem}", pytrace=False)


@pytest.fixture(scope="session")
def fixture_loop() -> Iterator[ThreadedLoop]:
    tl = ThreadedLoop()
    yield tl
    tl.close()


@pytest.fixture(scope="session")
def script_book() -> ScriptBook:
    return ScriptBook()


@pytest.fixture(scope="session")
def scripted_model(fixture_loop: ThreadedLoop, script_book: ScriptBook) -> Iterator[Any]:
    server = ScriptedModelServer(script_book, instance_name=MODEL_NAME)
    fixture_loop.run(server.start())
    yield server
    fixture_loop.run(server.stop())


@pytest.fixture(scope="session")
def scripted_model_url(scripted_model: Any) -> str:
    return str(scripted_model.url)


@pytest.fixture(scope="session")
def gym_log_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gym-logs")


@pytest.fixture(scope="session")
def genuine_stack(scripted_model_url: str, gym_log_root: Path) -> Iterator[GenuineStack]:
    """Genuine counter + circle_click resources servers, each behind a genuine simple_agent."""
    stack = GenuineStack(gym_log_root / "genuine_stack", with_head=True)
    add_scripted_model(stack, scripted_model_url)
    stack.add("counter", KIND_RESOURCES, "example_session_state_mgmt", domain="agent")
    add_genuine_simple_agent(stack, "counter_agent", "counter", max_steps=8)
    stack.add("circle_click", KIND_RESOURCES, "circle_click", domain="other")
    add_genuine_simple_agent(stack, "circle_click_agent", "circle_click", max_steps=1)
    stack.start()
    yield stack
    stack.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call" and report.failed:
        stacks = [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, GenuineStack)]
        for stack in stacks:
            report.sections.append(("genuine server logs", stack.log_tails()))
    return report
