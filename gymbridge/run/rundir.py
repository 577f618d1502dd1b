"""The run directory: one folder per training run that holds everything the run produced.

Layout (``gymbridge train --run-dir DIR``; default ``runs/<env>-<UTC timestamp>/``)::

    DIR/config.yaml       the resolved config (every default filled in); --resume reads it back
    DIR/dataset.ref.json  data.path by reference (path, size, sha256, rows): the rows the run trains on
    DIR/dataset.jsonl     or a copy of them (generated rows; data.copy_rows) (:mod:`gymbridge.run.data`)
    DIR/metrics.jsonl     one JSON object per step (:meth:`~gymbridge.run.report.StepReport.record`)
    DIR/failures.jsonl    one JSON object per failed rollout / group (always present, empty if none)
    DIR/checkpoints/      run checkpoints (see :mod:`gymbridge.trainer.checkpoint`)
    DIR/*.rewound.jsonl   lines a resume took out of metrics.jsonl / failures.jsonl (never deleted)

Invariants:

* a run directory is never deleted by the run that made it (it outlives the process), and no
  line a run wrote is ever lost: a rewrite moves lines, it never drops them;
* ``metrics.jsonl`` holds one line per step; a step's line is appended once the step is done,
  before the step's checkpoint is written, and synced to disk with ``failures.jsonl`` (fsync, as
  the checkpoint is), so after a crash or a power loss every checkpointed step has its line and
  its failure records. :meth:`RunDir.rewind` (``--resume``) moves the lines of steps after the
  checkpoint (and a torn last line) to ``metrics.rewound.jsonl``, so each step number appears once
  in ``metrics.jsonl`` of a resumed run;
* ``failures.jsonl`` is rewound the same way: only the records of rows the checkpoint counts as
  done stay (a row in flight at the crash runs again and records its failures again); the others
  move to ``failures.rewound.jsonl``;
* every rewrite is atomic (:func:`gymbridge.safe_io.write_atomic`); ``metrics.jsonl``'s rewind
  reads backwards from its end and cuts the file after its last kept line (the moved lines are
  appended to the ``.rewound`` file first), so a resume costs the lines it moves, not the run's
  length; nothing here holds a whole history file in memory.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson
import yaml

from gymbridge.errors import ConfigError
from gymbridge.rowset import RowSet
from gymbridge.safe_io import write_atomic

if TYPE_CHECKING:
    from gymbridge.run.config import RunConfig

logger = logging.getLogger(__name__)

__all__ = ["RunDir", "default_run_dir"]

RUNS_ROOT = Path("runs")


def default_run_dir(env: str, *, root: Path = RUNS_ROOT, now: dt.datetime | None = None) -> Path:
    """``<root>/<env>-<UTC timestamp>`` (``-2``, ``-3``, ... appended if that already exists)."""
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%SZ")
    base = root / f"{env}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _json_lines(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON-object lines of ``path``, streamed; a line that does not parse (torn by a crash) is
    skipped."""
    if not path.is_file():
        return
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                logger.warning("%s:%d: not JSON (torn by a crash?); dropped", path, lineno)
                continue
            if isinstance(obj, dict):
                yield obj


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory; :meth:`create` makes it (idempotent)."""

    path: Path

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def dataset_path(self) -> Path:
        return self.path / "dataset.jsonl"

    @property
    def dataset_ref_path(self) -> Path:
        return self.path / "dataset.ref.json"

    def dataset_rows(self, cfg: RunConfig) -> Path | Iterator[dict[str, Any]]:
        """What the bridge reads: ``dataset.jsonl``, or the referenced file's rows with ``cfg``'s
        defaults filled in, read lazily (:func:`gymbridge.run.data.dataset_rows`)."""
        from gymbridge.run.data import dataset_rows

        return dataset_rows(self, cfg)

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def failures_path(self) -> Path:
        return self.path / "failures.jsonl"

    @property
    def eval_path(self) -> Path:
        """``eval.jsonl``: one line per validation pass (:mod:`gymbridge.run.evaluation`)."""
        return self.path / "eval.jsonl"

    @property
    def eval_dir(self) -> Path:
        """``eval/``: ``step_<n>.jsonl``, the rollouts of the validation pass after step ``n``."""
        return self.path / "eval"

    @property
    def checkpoints_path(self) -> Path:
        return self.path / "checkpoints"

    @classmethod
    def create(cls, path: str | Path) -> RunDir:
        """Make ``path`` with ``checkpoints/`` and an (empty) ``failures.jsonl``; keep what exists."""
        run = cls(Path(path))
        try:
            run.checkpoints_path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError([f"run_dir: cannot create {run.path}: {exc.strerror or exc}"]) from exc
        run.failures_path.touch(exist_ok=True)
        return run

    # ------------------------------------------------------------------ config
    def write_config(self, data: Mapping[str, Any]) -> None:
        text = yaml.safe_dump(dict(data), sort_keys=False, allow_unicode=True)
        write_atomic(self.config_path, [text.encode()])

    def read_config(self) -> dict[str, Any]:
        """The saved config as a mapping (:class:`ConfigError` naming the file if it is missing or bad)."""
        where = str(self.config_path)
        try:
            data = yaml.safe_load(self.config_path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError([f"not a run directory: {exc.strerror or exc}"], source=where) from exc
        except yaml.YAMLError as exc:
            raise ConfigError([f"invalid YAML: {exc}"], source=where) from exc
        if not isinstance(data, dict):
            raise ConfigError(["top level must be a mapping"], source=where)
        return data

    # ------------------------------------------------------------------ metrics
    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one step's record (a whole line in one write), then sync it and ``failures.jsonl``."""
        created = not self.metrics_path.exists()
        with self.metrics_path.open("ab") as f:
            f.write(orjson.dumps(record, default=str, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        self._sync(self.failures_path)  # the bridge appends (and flushes) its records as they come
        if created:
            self._sync(self.path)  # the new file's directory entry

    def append_eval(self, record: Mapping[str, Any]) -> None:
        """Append one validation pass's record to ``eval.jsonl`` (a whole line in one write, synced)."""
        with self.eval_path.open("ab") as f:
            f.write(orjson.dumps(record, default=str, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            f.flush()
            os.fsync(f.fileno())

    def iter_eval(self) -> Iterator[dict[str, Any]]:
        """The records of ``eval.jsonl``, read line by line (none when the run never validated)."""
        return _json_lines(self.eval_path)

    @staticmethod
    def _sync(path: Path) -> None:
        """fsync ``path`` (a file or a directory): what any process wrote to it is on disk."""
        if not path.exists():
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            if path.is_dir():
                with contextlib.suppress(OSError):  # not every file system syncs a directory
                    os.fsync(fd)
            else:
                os.fsync(fd)
        finally:
            os.close(fd)

    def metrics(self) -> list[dict[str, Any]]:
        """Every record of ``metrics.jsonl`` (a long run's are many: :meth:`iter_metrics` streams)."""
        return list(self.iter_metrics())

    def iter_metrics(self) -> Iterator[dict[str, Any]]:
        """The records of ``metrics.jsonl``, read line by line."""
        return _json_lines(self.metrics_path)

    def has_metrics(self) -> bool:
        """Whether ``metrics.jsonl`` holds a line (without reading it)."""
        return self.metrics_path.is_file() and self.metrics_path.stat().st_size > 0

    def failures(self) -> list[dict[str, Any]]:
        return list(_json_lines(self.failures_path))

    def rewind(self, *, last_step: int, done_task_indices: Iterable[int]) -> int:
        """Set aside what happened after a checkpoint; returns the number of lines moved.

        Metrics and validation passes of steps after ``last_step`` (and lines that do not parse,
        torn by a crash) move to ``metrics.rewound.jsonl`` / ``eval.rewound.jsonl``; failure records
        of rows not in ``done_task_indices`` move to ``failures.rewound.jsonl``. Nothing is deleted.
        """
        done = done_task_indices if isinstance(done_task_indices, RowSet) else RowSet(done_task_indices)
        moved = self._split_tail(
            self.metrics_path, lambda r: isinstance(r.get("step"), int) and r["step"] <= last_step
        )
        moved += self._split(self.failures_path, lambda r: r.get("task_index") in done)
        moved += self._split_tail(  # validation passes follow their step: a pass after last_step goes
            self.eval_path, lambda r: isinstance(r.get("step"), int) and r["step"] <= last_step
        )
        return moved

    def set_aside(self) -> int:
        """Move every metrics and failure line to the ``*.rewound.jsonl`` files (a run started afresh
        in a directory whose earlier attempt left no checkpoint); returns the number of lines moved."""
        return sum(
            self._split(path, lambda r: False)
            for path in (self.metrics_path, self.failures_path, self.eval_path)
        )

    def _split(self, path: Path, keep: Any) -> int:
        """Keep the lines of ``path`` for which ``keep(record)`` holds; append the rest to its
        ``.rewound.jsonl`` sibling (that file first, so a crash in between duplicates, never loses).

        Streamed: a first pass appends the moved lines aside, a second (only when a line moved)
        rewrites the kept ones; memory does not grow with the file."""
        if not path.is_file():
            return 0

        def moves(line: bytes) -> bool:
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                return True
            return not (isinstance(record, dict) and keep(record))

        aside = path.with_name(path.name.removesuffix(".jsonl") + ".rewound.jsonl")
        moved = 0
        with contextlib.ExitStack() as stack:  # the moved lines go aside first (opened once one moves)
            out: IO[bytes] | None = None
            for line in stack.enter_context(path.open("rb")):
                if line.strip() and moves(line):
                    out = out or stack.enter_context(aside.open("ab"))
                    out.write(line.rstrip(b"\n") + b"\n")
                    moved += 1
        if moved:
            with path.open("rb") as f:
                write_atomic(
                    path, (line.rstrip(b"\n") + b"\n" for line in f if line.strip() and not moves(line))
                )
        return moved

    def _split_tail(self, path: Path, keep: Any) -> int:
        """:meth:`_split` for an append-only file whose kept lines come first (``metrics.jsonl``: one
        line per step, in step order): it reads backwards from the end up to the last line ``keep``
        holds, so its cost is the lines it moves, not the run's length."""
        if not path.is_file():
            return 0
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            end, tail = size, b""
            cut = 0  # the offset where the moved lines start
            while end > 0:
                start = max(0, end - (1 << 16))
                f.seek(start)
                tail = f.read(end - start) + tail
                end = start
                lines = tail.split(b"\n")
                first_whole = 0 if start == 0 else 1  # a block's first line may be cut off
                found = None
                offset = start + sum(len(x) + 1 for x in lines[:first_whole])
                offsets = []
                for line in lines[first_whole:]:
                    offsets.append(offset)
                    offset += len(line) + 1
                for line, at in zip(reversed(lines[first_whole:]), reversed(offsets), strict=True):
                    if not line.strip():
                        continue
                    try:
                        record = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        continue
                    if isinstance(record, dict) and keep(record):
                        found = at + len(line) + 1
                        break
                if found is not None:
                    cut = min(found, size)
                    break
            f.seek(cut)
            rest = f.read()
        moved = [line + b"\n" for line in rest.split(b"\n") if line.strip()]
        if moved:
            aside = path.with_name(path.name.removesuffix(".jsonl") + ".rewound.jsonl")
            with aside.open("ab") as out:
                out.writelines(moved)
                out.flush()
        if cut < size:
            with path.open("r+b") as f:
                f.truncate(cut)
                f.flush()
                os.fsync(f.fileno())
        return len(moved)
