"""Helpers of the run's tests: configs from the shipped overlays plus dotted settings, quiet runs."""

from __future__ import annotations

import io
import re
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gymbridge.run import RunConfig, RunSummary, load_run_config, train

SMALL: dict[str, Any] = {
    "steps": 2,
    "bridge.prompts_per_step": 1,
    "bridge.group_size": 2,
    "rollout.max_tokens": 6,
    "warmup.steps": 0,
}
"""A two-step colour run of 2 rollouts a step, without the format warm-up (seconds, not minutes)."""


def run_config(
    run_dir: Path | str | None,
    settings: Mapping[str, Any] | None = None,
    configs: Sequence[str] = ("smoke",),
) -> RunConfig:
    """``configs`` (shipped overlays) with ``settings`` (dotted keys) over them, in ``run_dir``."""
    overrides = list((settings or {}).items())
    if run_dir is not None:
        overrides.append(("output.run_dir", str(run_dir)))
    return load_run_config(list(configs), overrides)


def quiet_train(cfg: RunConfig, **kwargs: Any) -> tuple[RunSummary, str]:
    """Run ``cfg``; returns its summary and what the console printed."""
    out = io.StringIO()
    summary = train(cfg, out=out, **kwargs)
    return summary, out.getvalue()


def ports(text: str) -> list[int]:
    """The ports of the ``servers:`` line a run printed."""
    line = next(line for line in text.splitlines() if line.startswith("servers:"))
    return [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", line)]


def closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0
