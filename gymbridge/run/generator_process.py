"""The generator in its own OS process: ``gymbridge model serve`` as a child of the launcher.

:func:`start_model_server_process` starts ``python -m gymbridge.generation.cli serve ...`` in
a **new session** (its own process group), waits for its ``serving on URL`` line and returns
a :class:`ModelServerProcess`; :meth:`ModelServerProcess.stop` ends the whole group
(SIGTERM, then SIGKILL after a grace period) and reaps it. Use it as a context manager, or
register ``stop`` on an exit stack right away: the child is stopped whatever happens (an
exception, Ctrl-C, a child that never became ready).

Invariants: the child binds 127.0.0.1 on a free port unless told otherwise; its stderr is
appended to ``log_path`` (never a pipe nobody reads; never truncated: a resumed run keeps the
earlier attempts' logs, each start under a ``--- model server start`` line), its stdout is
drained by a daemon thread; a child that exits or stays silent past ``startup_timeout_s``
raises :class:`~gymbridge.errors.GeneratorProcessError` with the tail of its own attempt's log.
A secret (the run secret of the weight routes) reaches the child only through ``env``: never its
command line (``ps`` shows it, and the log's start line repeats it) nor the log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from gymbridge.errors import GeneratorProcessError

logger = logging.getLogger(__name__)

__all__ = [
    "ModelServerProcess",
    "start_model_server_process",
    "tiny_server_command",
]

_READY = re.compile(r"serving on (http://\S+)")


class ModelServerProcess:
    """A running ``gymbridge model serve`` child (see the module docstring)."""

    def __init__(
        self, proc: subprocess.Popen[str], log_path: Path, log_file: IO[str], log_offset: int = 0
    ) -> None:
        self.proc = proc
        self.log_path = log_path
        self._log_file = log_file
        self._log_offset = log_offset
        """Where this child's part of ``log_path`` starts (bytes; earlier attempts' logs before it)."""
        self.url = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines this child logged (not an earlier attempt's)."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        """End the child's whole process group and reap it (idempotent)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "model server %d ignored SIGTERM for %.0fs: killing it", self.proc.pid, grace_s
                )
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # a grandchild that outlived its parent still belongs to the group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log_file.close()

    def __enter__(self) -> ModelServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def tiny_server_command(
    *,
    seed: int,
    max_model_len: int,
    default_max_tokens: int,
    prompt_seed: int | None,
    enable_weight_updates: bool,
    host: str = "127.0.0.1",
    model_flag: str | Sequence[str] = "--tiny",
    port: int = 0,
    media_hosts: tuple[str, ...] = (),
    tool_parser: str = "auto",
) -> list[str]:
    """The ``gymbridge model serve --tiny`` (or ``model_flag``) command line the launcher runs as a child
    (``tool_parser`` other than ``auto`` becomes ``--tool-parser``). With ``enable_weight_updates`` the
    child needs the run secret: ``env={WEIGHTS_SECRET_ENV: secret}`` to
    :func:`start_model_server_process`."""
    cmd = [
        sys.executable,
        "-m",
        "gymbridge.generation.cli",
        "serve",
        *([model_flag] if isinstance(model_flag, str) else model_flag),
        "--seed",
        str(seed),
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--default-max-tokens",
        str(default_max_tokens),
    ]
    if prompt_seed is not None:
        cmd += ["--prompt-seed", str(prompt_seed)]
    if enable_weight_updates:
        cmd.append("--enable-weight-updates")
    for entry in media_hosts:
        cmd += ["--media-host", entry]
    if tool_parser != "auto":
        cmd += ["--tool-parser", tool_parser]
    return cmd


def start_model_server_process(
    command: Sequence[str],
    *,
    log_path: Path,
    startup_timeout_s: float = 180.0,
    env: Mapping[str, str] | None = None,
) -> ModelServerProcess:
    """Start ``command`` (a ``model serve`` line) in its own session; return once it serves.

    ``env``: variables set for the child on top of this process's environment (how the run secret
    reaches it; never logged). On any failure the child's group is stopped before
    :class:`GeneratorProcessError` is raised.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = log_path.open("a")  # history: a resumed run keeps the earlier attempts' logs
    log_offset = log_file.tell()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    log_file.write(f"--- model server start {stamp}: {' '.join(command)}\n")
    log_file.flush()
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=log_file,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its own process group: killpg ends it and anything it started
        env=child_env,
    )
    child = ModelServerProcess(proc, log_path, log_file, log_offset)
    try:
        child.url = _wait_ready(child, startup_timeout_s)
    except BaseException:
        child.stop()
        raise
    logger.info("model server process %d serving on %s", proc.pid, child.url)
    return child


def _wait_ready(child: ModelServerProcess, timeout_s: float) -> str:
    lines: queue.Queue[str | None] = queue.Queue()
    stdout = child.proc.stdout
    assert stdout is not None

    def drain() -> None:  # keeps reading after readiness so the child never blocks on a full pipe
        for line in stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=drain, name=f"model-server-{child.pid}-stdout", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise GeneratorProcessError(
                f"the model server process {child.pid} printed no 'serving on' line within {timeout_s:.0f}s; "
                f"log {child.log_path}:\n{child.log_tail()}"
            )
        try:
            line = lines.get(timeout=min(left, 0.5))
        except queue.Empty:
            if child.proc.poll() is not None:
                break
            continue
        if line is None:
            break
        found = _READY.search(line)
        if found:
            return found.group(1)
    child.proc.wait()
    raise GeneratorProcessError(
        f"the model server process {child.pid} exited with {child.proc.returncode} before serving; "
        f"log {child.log_path}:\n{child.log_tail()}"
    )
