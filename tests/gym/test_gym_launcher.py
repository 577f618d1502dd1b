"""Regression tests for the genuine-server launcher (``_genuine.GenuineStack``) under a busy machine.

Role: the fixtures of every other gym test rely on the launcher; these pin down the failure modes
found in review: a port taken between allocation and the genuine server's bind (the
free-port-then-bind race; 8 jobs share these machines) must restart the stack on fresh ports, not
fail the session; ports come from outside the kernel's ephemeral range; a killed test process must
not leave genuine servers running (``PR_SET_PDEATHSIG``); ``stop()`` leaves no process and no
temp folder behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from _genuine import HOST, KIND_RESOURCES, GenuineStack, _ephemeral_range, free_port

pytestmark = pytest.mark.gym

HERE = Path(__file__).parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_free_port_avoids_the_ephemeral_range() -> None:
    low, high = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(p < low or p > high for p in ports), (sorted(ports), low, high)
    assert len(ports) > 1  # random, so parallel sessions do not walk the same sequence


def test_regression_port_taken_before_bind_restarts_on_fresh_ports(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process binds the allocated port before the genuine server does: the stack retries."""
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind((HOST, 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    caplog.set_level("WARNING", logger="_genuine")
    stack = GenuineStack(tmp_path / "logs")
    inst = stack.add("counter", KIND_RESOURCES, "example_session_state_mgmt", port=taken, domain="agent")
    try:
        stack.start(ready_timeout_s=300)
        assert inst.port != taken
        assert httpx.get(stack.url("counter") + "/", trust_env=False, timeout=10).json() == {"status": "ok"}
        assert any("restarting on fresh ports" in r.getMessage() for r in caplog.records)
        assert f"port: {taken}" not in (tmp_path / "logs" / "config.yaml").read_text()
        pid = stack.processes["counter"].proc.pid
        job_tmp = stack.job_tmp
    finally:
        stack.stop()
        squatter.close()
    assert not _alive(pid)
    assert not job_tmp.exists()  # stop() removes the stack's own temp folder


def test_regression_killed_launcher_leaves_no_genuine_server(tmp_path: Path) -> None:
    """SIGKILL of the process that started a stack (a hard-killed pytest) takes its servers down too."""
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(HERE)!r})
        from pathlib import Path
        from _genuine import KIND_RESOURCES, GenuineStack
        stack = GenuineStack(Path({str(tmp_path / "logs")!r}))
        stack.add("counter", KIND_RESOURCES, "example_session_state_mgmt", domain="agent")
        stack.start(ready_timeout_s=300)
        print(stack.processes["counter"].proc.pid, stack.url("counter"), stack.job_tmp, flush=True)
        time.sleep(600)
        """
    )
    job_tmp: Path | None = None
    launcher = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline().split()
        assert len(line) == 3, f"launcher did not start a stack (rc={launcher.poll()})"
        server_pid, url, job_tmp = int(line[0]), line[1], Path(line[2])
        assert httpx.get(url + "/", trust_env=False, timeout=10).status_code == 200
        os.kill(launcher.pid, signal.SIGKILL)  # no teardown runs
        launcher.wait(10)
        deadline = time.monotonic() + 60  # SIGTERM on the launcher's death: shutdown takes seconds
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        leaked = _alive(server_pid)
        if leaked:  # clean up before failing: never leave it to the next job
            os.killpg(server_pid, signal.SIGKILL)
        assert not leaked, "genuine server outlived the killed launcher"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
        if job_tmp is not None:  # the killed launcher could not remove its temp folder: we do
            shutil.rmtree(job_tmp, ignore_errors=True)
