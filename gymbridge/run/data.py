"""The run's dataset: ``<run_dir>/dataset.jsonl``, the NeMo Gym rows the run trains on.

Rows come from ``data.path`` (validated line by line, :func:`~gymbridge.run.userenv.read_dataset`)
or from the environment's data generator (``steps x bridge.prompts_per_step`` rows, times the
extra rounds dynamic sampling may draw). Every row gets the run's sampling settings where it
sets none (``max_output_tokens``, ``temperature``, and ``top_p`` when it is not 1); a row asking
for another temperature or top-p than the trainer scores with is refused (the importance ratio
would compare two distributions).

Invariant: the file is written atomically, once; a resumed run trains the rows it wrote.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from gymbridge.errors import ConfigError
from gymbridge.safe_io import write_atomic

if TYPE_CHECKING:
    from gymbridge.run.config import RunConfig

__all__ = ["count_rows", "write_dataset"]


def count_rows(path: Path) -> int:
    return sum(1 for line in path.read_bytes().splitlines() if line.strip())


def write_dataset(cfg: RunConfig, spec: Any, path: Path) -> tuple[int, str]:
    """Write the run's rows to ``path``; returns their count and where they came from."""
    if cfg.data.path is not None:
        from gymbridge.run.userenv import read_dataset

        lines = [
            _row_line(cfg, orjson.loads(line), f"{cfg.data.path} line {i}")
            for i, line in enumerate(read_dataset(cfg.data.path), 1)
        ]
        write_atomic(path, lines)
        return len(lines), f"from {cfg.data.path}"
    spec.check_params(cfg.env.params)
    n = cfg.steps * cfg.bridge.prompts_per_step
    if cfg.bridge.dynamic_sampling:  # each batch may draw that many extra rounds of prompts
        n *= 1 + cfg.bridge.dynamic_sampling_max_rounds
    try:
        rows = list(spec.generate(n, cfg.seed, **cfg.env.params))
    except (TypeError, ValueError) as exc:  # a generator refusing its parameters
        raise ConfigError([f"env.params: {cfg.env.name} generator: {exc}"]) from exc
    lines = [_row_line(cfg, row, f"{cfg.env.name} row {index}") for index, row in enumerate(rows)]
    write_atomic(path, lines)
    return n, f"{cfg.env.name}, generated"


def _row_line(cfg: RunConfig, row: dict[str, Any], where: str) -> bytes:
    """``row`` as a dataset line with the run's sampling settings filled in (module docstring)."""
    rcp = dict(row["responses_create_params"])
    rcp.setdefault("max_output_tokens", cfg.rollout.max_tokens)
    rcp.setdefault("temperature", cfg.trainer.temperature)
    if cfg.trainer.top_p != 1.0:
        rcp.setdefault("top_p", cfg.trainer.top_p)
    for setting, trainer_value in (("temperature", cfg.trainer.temperature), ("top_p", cfg.trainer.top_p)):
        asked = rcp.get(setting, 1.0)
        if not isinstance(asked, (int, float)) or not math.isclose(float(asked), trainer_value, rel_tol=1e-9):
            raise ConfigError(
                [
                    f"trainer.{setting}: {where} asks for {setting}={asked} but the trainer scores with "
                    f"{setting}={trainer_value}: the importance ratio would be biased; set "
                    f"trainer.{setting} to the rows' value"
                ]
            )
    return orjson.dumps({**row, "responses_create_params": rcp}) + b"\n"
