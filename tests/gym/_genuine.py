"""Start genuine NeMo Gym 0.7.0 servers from ``.venv-gym`` as subprocesses (no ``gym`` CLI, no Ray).

Role: the launcher behind the ``gym`` conformance fixtures (``tests/gym/conftest.py``) and
``benchmarks/gym_bench.py``. gymbridge never imports ``nemo_gym``; this module only builds the
config a genuine server reads and runs ``python app.py`` in the gym venv.

How a genuine server starts (read from ``nemo_gym/server_utils.py`` / ``global_config.py``)::

    cd <gym site-packages>/<kind>/<impl>
    NEMO_GYM_CONFIG_DICT=<whole config, YAML>  NEMO_GYM_CONFIG_PATH=<instance name>  python app.py

The config dict maps ``instance -> kind -> implementation -> {host, port, entrypoint, ...}``; a
server resolves the other servers it calls (``model_server.name``, ``resources_server.name``) in
that same dict, so every instance of one stack shares one dict. ``head_server`` must be present
(servers only read it when the dict is injected) and ``dry_run`` must be false. With
``with_head=True`` the genuine head server is launched too (``HeadServer.run_webserver`` in a bare
process, as ``gym env start`` does in-process), for discovery via ``/global_config_dict_yaml``.
Non-genuine members of a stack (gymbridge's model double, our environments) appear in the dict
with their host/port only, so genuine agents can call them by name.

Invariants:
* every address is 127.0.0.1; ports are chosen free BELOW the kernel's ephemeral range, so no
  outgoing connection of another job can take one between allocation and the server's bind; a
  server that still loses its port (another job bound it) is detected ("address already in use"
  in its log) and the whole stack restarts on fresh ports, up to ``START_ATTEMPTS`` times;
* each server runs in its own process group, stopped with SIGTERM then SIGKILL, so uvicorn workers
  never outlive a test session; each also gets SIGTERM from the kernel if the launching process
  dies without tearing down (``PR_SET_PDEATHSIG``), so a killed pytest leaves no servers behind;
* the job-local temp folder is created on ``start()`` and removed on ``stop()``;
* each server's stdout+stderr goes to a log file whose tail is put in every failure message;
* the child environment keeps telemetry off and points TMPDIR/RAY_TMPDIR at a job-local folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

LOG = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
GYM_VENV = Path(os.environ.get("GYM_VENV", REPO_ROOT / ".venv-gym"))
GYM_PYTHON = GYM_VENV / "bin" / "python"
GYM_STAMP = GYM_VENV / ".gymbridge-gym-stamp"
# Written by scripts/setup_gym_venv.sh when a build fails, removed when one succeeds.
SETUP_FAILURE = REPO_ROOT / ".cache" / "gym-setup-failed"
REQUIRE_GYM = os.environ.get("GYMBRIDGE_REQUIRE_GYM") == "1"
NEMO_GYM_VERSION = "0.7.0"
HOST = "127.0.0.1"

KIND_RESOURCES = "resources_servers"
KIND_AGENTS = "responses_api_agents"
KIND_MODELS = "responses_api_models"
KIND_ENV_SERVERS = "environment_servers"


# The genuine head server has no app.py: `gym env start` runs it in-process. Same calls, no CLI.
HEAD_SERVER_MAIN = (
    "from nemo_gym.server_utils import HeadServer\n"
    "server, thread, head = HeadServer.run_webserver()\n"
    "head.mark_ready()\n"
    "thread.join()\n"
)


# Runs first in every launched child: ask the kernel for SIGTERM when the launching thread dies
# (prctl survives execve), then exec the real command. Not preexec_fn: unsafe with threads.
PDEATHSIG_EXEC = (
    "import ctypes, os, signal, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM) != 0:\n"  # 1 = PR_SET_PDEATHSIG
    "    print('warning: prctl(PR_SET_PDEATHSIG) failed', file=sys.stderr)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('launcher died before the server started')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
START_ATTEMPTS = 3
ADDRESS_IN_USE = ("address already in use", "Errno 98")


class GenuineServerError(RuntimeError):
    """A genuine server failed to start or died; the message carries its log tail."""


class PortTakenError(GenuineServerError):
    """A genuine server could not bind its port (another process took it after allocation)."""


def gym_venv_problem(venv: Path | None = None, setup_failure: Path | None = None) -> str | None:
    """Why the gym venv cannot be used, or ``None`` when it is ready.

    The reason names the fix, and carries the last failure ``scripts/setup_gym_venv.sh`` recorded
    (``.cache/gym-setup-failed``) when there is one, so a skipped suite says why it was skipped.
    """
    venv = GYM_VENV if venv is None else venv
    setup_failure = SETUP_FAILURE if setup_failure is None else setup_failure
    problem: str | None = None
    if not (venv / "bin" / "python").exists():
        problem = f"{venv} is absent: run `bash scripts/setup_gym_venv.sh` to build genuine nemo-gym"
    else:
        stamp_file = venv / GYM_STAMP.name
        stamp = stamp_file.read_text().strip() if stamp_file.exists() else ""
        if not stamp.endswith(f"nemo-gym=={NEMO_GYM_VERSION}"):
            problem = (
                f"{venv} is incomplete (no stamp for nemo-gym=={NEMO_GYM_VERSION}): "
                "rerun `bash scripts/setup_gym_venv.sh`"
            )
    if problem and setup_failure.exists():
        problem += f"; last setup failure: {setup_failure.read_text(errors='replace').strip()[-500:]}"
    return problem


def gym_site_packages() -> Path:
    """The gym venv's purelib folder (where ``resources_servers/`` etc. live)."""
    out = subprocess.run(
        [str(GYM_PYTHON), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the ephemeral range when possible.

    ``bind(0)`` would hand out an ephemeral port: between this call and the server's own bind (a
    genuine server needs seconds to import), any outgoing connection on the machine may take it.
    Ports below the ephemeral range are only ever taken by an explicit bind.
    """
    low, _ = _ephemeral_range()
    lo, hi = 20000, min(low, 32768) - 1
    rng = random.SystemRandom()
    if hi - lo > 1000:
        for _ in range(50):
            port = rng.randint(lo, hi)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((HOST, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def child_env(job_tmp: Path) -> dict[str, str]:
    """Environment for genuine servers: loopback only, telemetry off, job-local temp dirs."""
    job_tmp.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(
        {
            "TMPDIR": str(job_tmp),
            "RAY_TMPDIR": str(job_tmp),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "disabled",
            # single-node Ray on loopback: no node-IP probe towards outside addresses
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "WANDB_MODE": "disabled",
            "WANDB_SILENT": "true",
            "MLFLOW_TRACKING_URI": (job_tmp / "mlruns").as_uri(),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "DO_NOT_TRACK": "1",
            "OTEL_SDK_DISABLED": "true",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
            "PYTHONUNBUFFERED": "1",
        }
    )
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(proxy, None)
    return env


@dataclass
class Instance:
    """One server instance of a stack: genuine (``launch=True``) or external (address only)."""

    name: str
    kind: str
    impl: str
    port: int
    extra: dict[str, Any] = field(default_factory=dict)
    launch: bool = True

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def config_entry(self) -> dict[str, Any]:
        body: dict[str, Any] = {"entrypoint": "app.py", "host": HOST, "port": self.port}
        body.update(self.extra)
        return {self.kind: {self.impl: body}}


def ref(kind: str, name: str) -> dict[str, str]:
    """A server reference as genuine configs write it (``resources_server: {type, name}``)."""
    return {"type": kind, "name": name}


class GenuineProcess:
    """A running genuine server; ``stop()`` kills its whole process group."""

    def __init__(self, instance: Instance, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.instance = instance
        self.proc = proc
        self.log_path = log_path

    @property
    def url(self) -> str:
        return self.instance.url

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return text[-max_chars:]

    def check_alive(self) -> None:
        rc = self.proc.poll()
        if rc is not None:
            tail = self.log_tail()
            if any(marker in tail for marker in ADDRESS_IN_USE):
                raise PortTakenError(
                    f"genuine {self.instance.impl} ({self.instance.name}) could not bind port "
                    f"{self.instance.port}; log tail:\n{tail}"
                )
            raise GenuineServerError(
                f"genuine {self.instance.impl} ({self.instance.name}) exited with {rc}; log tail:\n"
                f"{self.log_tail()}"
            )

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=grace_s)


class GenuineStack:
    """A set of server instances sharing one NeMo Gym config dict.

    Add instances (genuine ones get launched, external ones are only named in the config), then
    ``start()`` launches every genuine one in parallel and waits until all answer ``GET /``.
    """

    def __init__(self, log_dir: Path, *, job_tmp: Path | None = None, with_head: bool = False) -> None:
        self.log_dir = log_dir
        self.with_head = with_head
        """Also launch the genuine head server (``GET /global_config_dict_yaml``) on ``head_port``."""
        self._own_tmp = job_tmp is None
        self._job_tmp = job_tmp
        self.head_port = free_port()
        self.instances: dict[str, Instance] = {}
        self.processes: dict[str, GenuineProcess] = {}
        self._site: Path | None = None

    def add(
        self,
        name: str,
        kind: str,
        impl: str,
        *,
        port: int | None = None,
        launch: bool = True,
        **extra: Any,
    ) -> Instance:
        if name in self.instances:
            raise ValueError(f"instance {name!r} already in the stack")
        inst = Instance(name, kind, impl, port or free_port(), dict(extra), launch)
        self.instances[name] = inst
        return inst

    @property
    def job_tmp(self) -> Path:
        """TMPDIR/RAY_TMPDIR of the stack's processes; created on first use, removed by ``stop()``."""
        if self._job_tmp is None:
            # short on purpose: Ray puts unix sockets under RAY_TMPDIR (107-byte path limit)
            self._job_tmp = Path(tempfile.mkdtemp(prefix="gbgym-"))
        return self._job_tmp

    def config_dict(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            # Read (never contacted) by every genuine server when the dict is injected.
            "head_server": {"host": HOST, "port": self.head_port},
            "dry_run": False,
        }
        for inst in self.instances.values():
            cfg[inst.name] = inst.config_entry()
        return cfg

    def config_yaml(self) -> str:
        return yaml.safe_dump(self.config_dict(), sort_keys=False)

    def url(self, name: str) -> str:
        if name == "head_server":
            return f"http://{HOST}:{self.head_port}"
        return self.instances[name].url

    def start(self, ready_timeout_s: float = 300.0) -> None:
        """Launch every genuine member, wait until all answer; on a lost port, restart on fresh ports."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._start_once(ready_timeout_s)
                return
            except PortTakenError as exc:
                if attempt == START_ATTEMPTS:
                    raise
                LOG.warning("genuine stack: %s; restarting on fresh ports (attempt %d)", exc, attempt + 1)
                self.reassign_ports()

    def reassign_ports(self) -> None:
        """Fresh ports for every launched member (and the head); external members keep theirs."""
        self.head_port = free_port()
        for inst in self.instances.values():
            if inst.launch:
                inst.port = free_port()

    def _start_once(self, ready_timeout_s: float) -> None:
        if self._site is None:
            self._site = gym_site_packages()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.config_yaml()
        (self.log_dir / "config.yaml").write_text(cfg)
        env = child_env(self.job_tmp)
        env["NEMO_GYM_CONFIG_DICT"] = cfg
        launches: list[tuple[Instance, Path, list[str]]] = []
        for inst in self.instances.values():
            if not inst.launch or inst.name in self.processes:
                continue
            cwd = self._site / inst.kind / inst.impl
            if not (cwd / "app.py").exists():
                raise GenuineServerError(f"no genuine {inst.kind}/{inst.impl} in {self._site}")
            launches.append((inst, cwd, [str(GYM_PYTHON), "app.py"]))
        if self.with_head and "head_server" not in self.processes:
            head = Instance("head_server", "head_server", "head_server", self.head_port)
            launches.append((head, self._site, [str(GYM_PYTHON), "-c", HEAD_SERVER_MAIN]))
        for inst, cwd, argv in launches:
            log_path = self.log_dir / f"{inst.name}.log"
            log_file = log_path.open("wb")
            proc = subprocess.Popen(
                [sys.executable, "-c", PDEATHSIG_EXEC, str(os.getpid()), *argv],
                cwd=cwd,
                env={**env, "NEMO_GYM_CONFIG_PATH": inst.name},
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            log_file.close()
            self.processes[inst.name] = GenuineProcess(inst, proc, log_path)
        self.wait_ready(ready_timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = dict(self.processes)
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                for name, gp in list(pending.items()):
                    try:
                        gp.check_alive()
                    except GenuineServerError:
                        self.stop()
                        raise
                    try:
                        if client.get(gp.url + "/").status_code == 200:
                            del pending[name]
                    except httpx.TransportError:
                        pass
                if not pending:
                    break
                if time.monotonic() > deadline:  # wallclock-ok: hang guard (a start takes 5-30 s)
                    tails = "\n".join(f"--- {n}:\n{gp.log_tail(2000)}" for n, gp in pending.items())
                    self.stop()
                    raise GenuineServerError(f"genuine servers not ready after {timeout_s:.0f} s:\n{tails}")
                time.sleep(0.2)
        # A foreign listener could have answered for a server that then failed to bind: re-check.
        time.sleep(0.2)
        for gp in self.processes.values():
            try:
                gp.check_alive()
            except GenuineServerError:
                self.stop()
                raise

    def check_alive(self) -> None:
        for gp in self.processes.values():
            gp.check_alive()

    def log_tails(self, max_chars: int = 2000) -> str:
        return "\n".join(f"--- {n}:\n{gp.log_tail(max_chars)}" for n, gp in self.processes.items())

    def stop(self) -> None:
        """Stop every launched member (process group); remove the stack's own temp folder."""
        for gp in self.processes.values():
            gp.stop()
        self.processes.clear()
        if self._own_tmp and self._job_tmp is not None:
            shutil.rmtree(self._job_tmp, ignore_errors=True)
            self._job_tmp = None

    def collect(
        self,
        agent_name: str,
        input_jsonl: Path,
        output_jsonl: Path,
        *,
        num_repeats: int = 1,
        num_samples_in_parallel: int = 8,
        timeout_s: float = 180.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the genuine collector (``gym eval run --no-serve``'s library entry point) on this stack.

        Rows go through the genuine ``environment_servers/legacy_agent`` of ``agent_name`` (0.7.0
        collects through environment servers); add one with :meth:`add` first.
        """
        cfg = self.config_dict()
        cfg.update(
            {
                "agent_name": agent_name,
                "input_jsonl_fpath": str(input_jsonl),
                "output_jsonl_fpath": str(output_jsonl),
                "num_repeats": num_repeats,
                "num_samples_in_parallel": num_samples_in_parallel,
            }
        )
        env = child_env(self.job_tmp)
        env["NEMO_GYM_CONFIG_DICT"] = yaml.safe_dump(cfg, sort_keys=False)
        argv = [str(GYM_PYTHON), "-c", "from nemo_gym.cli.eval import collect_rollouts; collect_rollouts()"]
        proc = subprocess.Popen(
            [sys.executable, "-c", PDEATHSIG_EXEC, str(os.getpid()), *argv],
            cwd=output_jsonl.parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # the whole group: whatever the collector started must not outlive the test
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise GenuineServerError(
                f"genuine collector still running after {timeout_s:.0f} s; stderr tail:\n{err[-3000:]}"
            ) from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@contextlib.contextmanager
def running(stack: GenuineStack, ready_timeout_s: float = 300.0) -> Iterator[GenuineStack]:
    stack.start(ready_timeout_s)
    try:
        yield stack
    finally:
        stack.stop()


def strip_volatile(obj: Any, keys: Mapping[str, Any] | None = None) -> Any:
    """Replace run-dependent values (ids, timestamps, cookies) with placeholders for golden files."""
    volatile = dict(keys or {"id": "<id>", "created_at": 0, "call_id": None, "response_id": "<id>"})
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            if k in volatile and isinstance(v, str | int | float) and volatile[k] is not None:
                out[k] = volatile[k]
            else:
                out[k] = strip_volatile(v, volatile)
        return out
    if isinstance(obj, list):
        return [strip_volatile(v, volatile) for v in obj]
    return obj


if __name__ == "__main__":  # manual smoke: python tests/gym/_genuine.py
    logging.basicConfig(level=logging.INFO)
    problem = gym_venv_problem()
    if problem:
        sys.exit(problem)
    st = GenuineStack(Path("/tmp/gym-smoke"))
    st.add("counter", KIND_RESOURCES, "example_session_state_mgmt", domain="agent")
    with running(st):
        print(httpx.get(st.url("counter") + "/", trust_env=False).json())
