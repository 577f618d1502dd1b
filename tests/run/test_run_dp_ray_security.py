"""A ``dp.workers=2`` run's own Ray listens on loopback only, with token auth on.

The run starts Ray itself (no ``dp.ray_address``) in an environment with none of
``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH``, as a user's shell has them. At its
first step the test lists the listening TCP sockets of the driver and of every process under it
(GCS, raylet, agents, the two DP workers and their gloo group) and asks the GCS for a connection
with no token and with a wrong one. docs/security.md, "Ray".
"""

from __future__ import annotations

import io
import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from gymbridge.cli import main

pytestmark = pytest.mark.integration

ASK_GCS = (
    "import sys; from ray._raylet import GcsClient; "
    "GcsClient(address=sys.argv[1]).internal_kv_keys(b'', None, timeout=20)"
)
"""A process of this machine asking the run's GCS for its keys (the first thing a client does)."""


def _is_loopback(host: str) -> bool:
    ip = ipaddress.ip_address(host)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


def _listening(psutil: Any) -> dict[str, list[str]]:
    """``"pid name"`` -> the ``ip:port`` of every listening TCP socket, for this process and all under it."""
    me = psutil.Process()
    found: dict[str, list[str]] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            sockets = proc.net_connections(kind="tcp")
            name = proc.name()
        except psutil.NoSuchProcess:
            continue
        found[f"{proc.pid} {name}"] = [
            f"{c.laddr.ip}:{c.laddr.port}" for c in sockets if c.status == psutil.CONN_LISTEN
        ]
    return found


def _argv_and_env(psutil: Any) -> dict[str, tuple[str, dict[str, str]]]:
    """``"pid name"`` -> (command line, environment) of every process under this one."""
    out = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            out[f"{proc.pid} {proc.name()}"] = (" ".join(proc.cmdline()), proc.environ())
        except psutil.Error:
            continue
    return out


def _join(gcs_address: str, auth_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")} | auth_env
    return subprocess.run(
        [sys.executable, "-c", ASK_GCS, gcs_address],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture
def shell_without_ray_auth() -> Iterator[None]:
    """The environment of a user who set no Ray auth (restored afterwards, as Ray changes it)."""
    from gymbridge.trainer.ray_dp import RAY_AUTH_ENV

    with mock.patch.dict(os.environ):
        for name in RAY_AUTH_ENV:
            os.environ.pop(name, None)
        yield


def test_a_dp_run_s_own_ray_listens_on_loopback_with_token_auth(
    tmp_path: Path, shell_without_ray_auth: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray = pytest.importorskip("ray")
    psutil = pytest.importorskip("psutil")
    from gymbridge.trainer.ray_dp import RayDPTrainer

    assert not ray.is_initialized()
    # what listened before the run is not the run's (an earlier test of this pytest worker may have
    # left a server of its own in this process)
    before = {(proc, addr) for proc, addrs in _listening(psutil).items() for addr in addrs}
    seen: dict[str, Any] = {}
    step = RayDPTrainer.step

    def step_and_look(self: RayDPTrainer, batch: Any) -> Any:
        if not seen:  # the workers have formed their group: every socket of the run is up
            token_path = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
            gcs = ray.get_runtime_context().gcs_address
            seen.update(
                listening=_listening(psutil),
                processes=_argv_and_env(psutil),
                auth_mode=os.environ.get("RAY_AUTH_MODE"),
                token_path=token_path,
                token=token_path.read_text(),
                token_mode=token_path.stat().st_mode & 0o777,
                gcs=gcs,
                no_token=_join(gcs, {"RAY_AUTH_MODE": "disabled"}),
                wrong_token=_join(gcs, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}),
            )
        return step(self, batch)

    monkeypatch.setattr(RayDPTrainer, "step", step_and_look)
    argv = ["smoke", "run", "--steps", "1", "--prompts", "2", "--group-size", "4"]
    argv += ["--run-dir", str(tmp_path), "--no-progress", "--set", "dp.workers=2"]
    argv += ["--set", "rollout.max_tokens=16", "--set", "warmup.steps=0"]
    with redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    assert not ray.is_initialized()  # the run stopped the Ray it started

    listening = seen["listening"]
    names = [key.split(" ", 1)[1] for key in listening]
    assert "gcs_server" in names and "raylet" in names and names.count("ray::DPWorker") == 2
    assert listening[next(k for k in listening if k.endswith(" raylet"))]  # the probe sees sockets
    outside = {
        proc: [a for a in addrs if not _is_loopback(a.rsplit(":", 1)[0]) and (proc, a) not in before]
        for proc, addrs in listening.items()
    }
    assert not any(outside.values()), {proc: addrs for proc, addrs in outside.items() if addrs}
    assert _is_loopback(seen["gcs"].rsplit(":", 1)[0])

    # auth: on, with a token made for the run, and a process without it is turned away
    assert seen["auth_mode"] == "token"
    assert seen["token_mode"] == 0o600 and len(seen["token"]) == 64
    assert not seen["token_path"].is_relative_to(tmp_path)
    for refused in (seen["no_token"], seen["wrong_token"]):
        assert refused.returncode != 0 and "InvalidAuthToken" in refused.stderr, refused.stderr[-2000:]
    # the token travels by path: in no process's argv or environment, nor any file of the run directory
    for cmdline, env in seen["processes"].values():
        assert seen["token"] not in cmdline and seen["token"] not in env.values()
    workers = [env for key, (_, env) in seen["processes"].items() if key.endswith(" ray::DPWorker")]
    assert len(workers) == 2
    for env in workers:  # their gloo pairs listen on loopback even where the host name is not
        assert env["RAY_AUTH_TOKEN_PATH"] == str(seen["token_path"]) and env["GLOO_SOCKET_IFNAME"] == "lo"
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert seen["token"].encode() not in path.read_bytes(), path
