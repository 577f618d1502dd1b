"""The run's dataset: the NeMo Gym rows a run trains on, and how its run directory keeps them.

Rows come from ``data.path`` (a user's jsonl) or from the environment's data generator
(``steps x bridge.prompts_per_step`` rows, times the extra rounds dynamic sampling may draw).
With ``env.mix`` the generated rows interleave the environments' own by weight
(:func:`mixed_order`) and each carries ``agent_ref`` naming its environment; rows of
``data.path`` must name one of the mix's environments (``env.head_url``: an agent) themselves.
Every row gets the run's sampling settings where it sets none (``max_output_tokens``,
``temperature``, and ``top_p`` when it is not 1); a row asking for another temperature or top-p
than the trainer scores with is refused (the importance ratio would compare two distributions).

Layout in the run directory (:class:`~gymbridge.run.rundir.RunDir`)::

    dataset.ref.json   data.path by reference (the default): {"path": absolute path,
                       "size": bytes, "sha256": hex, "rows": count}; the bridge reads that file
                       lazily and fills the defaults in per row as it reads it
    dataset.jsonl      a copy, defaults filled in: a generated dataset, or data.path with
                       data.copy_rows: true

Invariants:

* ``data.path`` is read in one streaming pass at start-up (:class:`DatasetReader`: memory bounded
  by the longest line, not the file): every bad line is named (the first
  :data:`MAX_NAMED_PROBLEMS`, then a count), and the same pass gives the row count, size and
  sha256. Nothing reads a dataset whole, and no row list is built, generated rows included;
* a run directory holds one of the two files, written atomically, once; a resumed run trains the
  rows it began with: a copy as it is, a reference only while the file's size and sha256 are
  unchanged (:func:`resume_dataset` raises :class:`~gymbridge.errors.ResumeError` otherwise);
* the bridge's task indices are the positions of the non-blank lines, so a reference and a copy
  of one file give every row the same index and the same filled-in defaults.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError

from gymbridge.errors import ConfigError, ResumeError
from gymbridge.protocol import RunRequest
from gymbridge.run.userenv import EnvMix
from gymbridge.safe_io import write_atomic

if TYPE_CHECKING:
    from gymbridge.run.config import RunConfig
    from gymbridge.run.rundir import RunDir

__all__ = [
    "MAX_NAMED_PROBLEMS",
    "PROGRESS_EVERY_BYTES",
    "DatasetFile",
    "DatasetReader",
    "count_rows",
    "dataset_rows",
    "generated_rows",
    "mixed_order",
    "resume_dataset",
    "write_dataset",
    "write_run_dataset",
]

MAX_NAMED_PROBLEMS = 20
"""Bad lines a :class:`~gymbridge.errors.ConfigError` names one by one; the rest are counted."""
PROGRESS_EVERY_BYTES = 1 << 30
"""A pass over a dataset reports its progress after every this many bytes."""

Progress = Callable[[str], None]
"""Takes one progress line (the recipe's ``say``)."""


@dataclass(frozen=True)
class DatasetFile:
    """One jsonl dataset as a pass over it found it; ``len()`` is its row count."""

    path: Path
    """Absolute."""
    size_bytes: int
    sha256: str
    """Of the whole file, hex."""
    rows: int
    """Non-blank lines (each a valid row)."""

    def __len__(self) -> int:
        return self.rows

    def to_json(self) -> dict[str, Any]:
        """The ``dataset.ref.json`` object."""
        return {"path": str(self.path), "size": self.size_bytes, "sha256": self.sha256, "rows": self.rows}

    @classmethod
    def from_json(cls, data: Any) -> DatasetFile:
        """Read a ``dataset.ref.json`` object back (``ValueError`` when it is not one)."""
        ok = (
            isinstance(data, dict)
            and isinstance(data.get("path"), str)
            and isinstance(data.get("sha256"), str)
            and all(type(data.get(k)) is int for k in ("size", "rows"))  # bool is no count
        )
        if not ok:
            raise ValueError(f"not a dataset reference: {str(data)[:200]}")
        return cls(Path(data["path"]), data["size"], data["sha256"], data["rows"])

    def describe(self) -> str:
        return f"{_size_text(self.size_bytes)}, sha256 {self.sha256[:12]}"


class DatasetReader:
    """One streaming pass over the jsonl ``path``: iterate it for ``(line number, row)`` of each valid row.

    A row is a NeMo Gym dataset row: a JSON object with ``responses_create_params`` (the
    Responses-API request: ``input`` etc.) plus any other keys (kept verbatim), valid against
    :class:`~gymbridge.protocol.RunRequest`; blank lines are skipped. A bad line is not yielded;
    it is a problem :meth:`result` raises, as is any the caller adds with :meth:`refuse`. The
    pass hashes and counts every byte it reads, and calls ``progress`` after every
    ``progress_every_bytes``.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        progress: Progress | None = None,
        progress_every_bytes: int = PROGRESS_EVERY_BYTES,
    ) -> None:
        self.path = Path(os.path.abspath(path))
        self.progress = progress
        self.progress_every_bytes = progress_every_bytes
        self.problems: list[str] = []
        """The first :data:`MAX_NAMED_PROBLEMS` problems."""
        self.unnamed_problems = 0
        self._rows = 0
        self._size_bytes = 0
        self._sha256 = hashlib.sha256()
        self._started = self._finished = False

    def refuse(self, problem: str) -> None:
        """Count ``problem`` (named while fewer than :data:`MAX_NAMED_PROBLEMS` are)."""
        if len(self.problems) < MAX_NAMED_PROBLEMS:
            self.problems.append(problem)
        else:
            self.unnamed_problems += 1

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        if self._started:
            raise RuntimeError("a DatasetReader makes one pass; make another reader")
        self._started = True
        try:
            f = self.path.open("rb")
        except OSError as exc:
            raise ConfigError([f"dataset: cannot read {self.path}: {exc.strerror or exc}"]) from exc
        with f:
            total = os.fstat(f.fileno()).st_size
            report_at = self.progress_every_bytes
            for lineno, line in enumerate(f, 1):
                self._sha256.update(line)
                self._size_bytes += len(line)
                if self.progress is not None and self._size_bytes >= report_at:
                    report_at += self.progress_every_bytes
                    self.progress(
                        f"dataset: checking {self.path}: {_size_text(self._size_bytes)} of "
                        f"{_size_text(total)}, {self._rows} rows so far"
                    )
                if not line.strip():
                    continue
                row = self._row(line, f"{self.path}:{lineno}")
                if row is not None:
                    self._rows += 1
                    yield lineno, row
        self._finished = True

    def _row(self, line: bytes, where: str) -> dict[str, Any] | None:
        """``line`` as a row, or ``None`` after refusing it."""
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            self.refuse(f"{where}: not JSON: {exc}")
            return None
        if not isinstance(row, dict):
            self.refuse(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            return None
        rcp = row.get("responses_create_params")
        if not isinstance(rcp, dict) or "input" not in rcp:
            self.refuse(f"{where}: responses_create_params with an input is required (a NeMo Gym row)")
            return None
        try:
            RunRequest.model_validate(row)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            self.refuse(f"{where}: {loc}: {first['msg']}")
            return None
        return row

    def result(self) -> DatasetFile:
        """What the finished pass found; :class:`ConfigError` naming every problem, or a file without rows."""
        if not self._finished:
            raise RuntimeError("DatasetReader.result() before the pass finished")
        if self.problems:
            more = [f"and {self.unnamed_problems} more bad line(s)"] if self.unnamed_problems else []
            raise ConfigError([*self.problems, *more])
        if not self._rows:
            raise ConfigError([f"dataset: {self.path} holds no rows"])
        return DatasetFile(self.path, self._size_bytes, self._sha256.hexdigest(), self._rows)


def count_rows(path: Path) -> int:
    """Non-blank lines of ``path`` (read line by line)."""
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def write_dataset(
    cfg: RunConfig, spec: Any, path: Path, *, progress: Progress | None = None
) -> tuple[int, str]:
    """Write a copy of the run's rows to ``path``, defaults filled in; returns their count and origin.

    ``data.path`` is validated in the same pass that copies it; generated rows are written as the
    generator yields them. Either way the file appears whole (atomically) or not at all.
    """
    if cfg.data.path is not None:
        reader = DatasetReader(cfg.data.path, progress=progress)
        write_atomic(path, _checked_lines(cfg, reader))
        return len(reader.result()), f"from {reader.path}"
    _check_generator_params(cfg, spec)
    n = cfg.steps * cfg.bridge.prompts_per_step
    if cfg.bridge.dynamic_sampling:  # each batch may draw that many extra rounds of prompts
        n *= 1 + cfg.bridge.dynamic_sampling_max_rounds
    written = 0
    what = cfg.env.name if not isinstance(spec, EnvMix) else "env.mix"

    def lines() -> Iterator[bytes]:
        nonlocal written
        for row in generated_rows(cfg, spec, n, seed=cfg.seed):
            yield _row_line(cfg, row, f"{what} row {written}")
            written += 1

    write_atomic(path, lines())
    if isinstance(spec, EnvMix):
        shares = ", ".join(f"{e.label} x{e.weight:g}" for e in spec.envs)
        return written, f"a mix of {shares}, generated"
    return written, f"{cfg.env.name}, generated"


def _check_generator_params(cfg: RunConfig, spec: Any) -> None:
    """The generator parameters of the run's environment, or of each of a mix's: every problem at once."""
    if not isinstance(spec, EnvMix):
        spec.check_params(cfg.env.params)
        return
    problems: list[str] = []
    for i, env in enumerate(spec.envs):
        try:
            env.spec.check_params(env.params)
        except ConfigError as exc:
            problems += [f"env.mix[{i}].params: {p}" for p in exc.problems]
    if problems:
        raise ConfigError(problems)


def generated_rows(cfg: RunConfig, spec: Any, n: int, *, seed: int) -> Iterator[dict[str, Any]]:
    """The environment generator's ``n`` rows at ``seed`` as it yields them (the run's dataset at
    ``cfg.seed``; validation rows at another seed).

    ``spec`` an :class:`~gymbridge.run.userenv.EnvMix`: its environments' rows in
    :func:`mixed_order`, each with ``agent_ref`` naming its environment's label; environment ``k``
    contributes its own generator's first rows at ``seed`` (a second entry of the same environment:
    at a seed derived from ``seed`` and its label), so the same ``seed`` gives the same rows and
    another seed other rows, every environment's included."""
    if isinstance(spec, EnvMix):
        yield from _mixed_rows(spec, n, seed)
        return
    try:
        yield from spec.generate(n, seed, **cfg.env.params)
    except (TypeError, ValueError) as exc:  # a generator refusing its parameters
        raise ConfigError([f"env.params: {cfg.env.name} generator: {exc}"]) from exc


def mixed_order(weights: Sequence[float], n: int) -> Iterator[int]:
    """The environment (its index in ``weights``) of each of ``n`` mixed rows: smooth weighted round robin.

    Deterministic; in every prefix each environment's count stays within one row of its share
    ``n * w_k / sum(w)`` for two environments (below ``len(weights) - 1`` rows for more), so each
    step's prompts mix the environments as the weights say, not only the whole dataset."""
    total = float(sum(weights))
    current = [0.0] * len(weights)
    for _ in range(n):
        for k, w in enumerate(weights):
            current[k] += w
        pick = max(range(len(weights)), key=current.__getitem__)  # the first of equals
        current[pick] -= total
        yield pick


def _mixed_rows(mix: EnvMix, n: int, seed: int) -> Iterator[dict[str, Any]]:
    from gymbridge.client import agent_ref

    counts = [0] * len(mix.envs)
    for k in mixed_order([e.weight for e in mix.envs], n):
        counts[k] += 1
    seen: set[str] = set()
    streams: list[Iterator[dict[str, Any]]] = []
    for env, count in zip(mix.envs, counts, strict=True):
        name = str(getattr(env.spec, "name", env.label))
        own = seed if name not in seen else _derived_seed(seed, env.label)
        seen.add(name)
        streams.append(iter(env.spec.generate(count, own, **env.params)))
    for k in mixed_order([e.weight for e in mix.envs], n):
        env = mix.envs[k]
        try:
            row = next(streams[k])
        except (TypeError, ValueError) as exc:  # a generator refusing its parameters
            raise ConfigError([f"env.mix[{k}].params: {env.spec.name} generator: {exc}"]) from exc
        except StopIteration:  # a generator that gave fewer rows than asked
            raise ConfigError(
                [f"env.mix[{k}]: {env.spec.name} generated fewer than {counts[k]} rows"]
            ) from None
        yield {**row, "agent_ref": agent_ref(env.label)}


def _derived_seed(seed: int, label: str) -> int:
    """A seed of its own for a repeated environment's rows (a 63-bit hash of ``seed`` and ``label``)."""
    digest = hashlib.blake2b(f"{seed}/{label}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def write_run_dataset(cfg: RunConfig, spec: Any, run_dir: RunDir, *, progress: Progress | None = None) -> str:
    """Give a fresh run its dataset (module docstring: a reference, or a copy); returns the line to print.

    An earlier attempt's dataset file of the other kind is removed first (a fresh start rewrites
    the dataset, and the bridge must find one file only).
    """
    if cfg.data.path is None or cfg.data.copy_rows:
        run_dir.dataset_ref_path.unlink(missing_ok=True)
        n, origin = write_dataset(cfg, spec, run_dir.dataset_path, progress=progress)
        return f"dataset: {n} rows ({origin}) -> {run_dir.dataset_path}"
    run_dir.dataset_path.unlink(missing_ok=True)
    reader = DatasetReader(cfg.data.path, progress=progress)
    for _ in _checked_lines(cfg, reader):
        pass
    found = reader.result()
    write_atomic(
        run_dir.dataset_ref_path, [orjson.dumps(found.to_json(), option=orjson.OPT_INDENT_2) + b"\n"]
    )
    return (
        f"dataset: {found.rows} rows (from {found.path}) by reference: {found.describe()} "
        f"-> {run_dir.dataset_ref_path}"
    )


def resume_dataset(run_dir: RunDir, *, progress: Progress | None = None) -> str | None:
    """Check a resumed run's dataset; returns the line to print, ``None`` when the run has none yet.

    A copy is kept as it is. A reference is re-checked (the file's size and the sha256 of all of
    it, read in chunks): a file that moved or changed raises :class:`~gymbridge.errors.ResumeError` naming
    it, with the size and sha256 expected and found.
    """
    if run_dir.dataset_ref_path.is_file():
        ref = _read_ref(run_dir)
        found = _file_digest(ref.path, progress)
        if found is None or found != (ref.size_bytes, ref.sha256):
            what = (
                "is missing (moved or deleted?)"
                if found is None
                else f"changed: found {found[0]} bytes, sha256 {found[1]}"
            )
            raise ResumeError(
                run_dir.path,
                f"the run's dataset {ref.path} {what}; the run began with {ref.size_bytes} bytes, sha256 "
                f"{ref.sha256} ({run_dir.dataset_ref_path}). A resumed run must train the rows it began "
                "with: put that file back, or start a new run (--run-dir)",
            )
        return (
            f"dataset: {ref.rows} rows (from {ref.path}) by reference, unchanged: {ref.describe()} "
            f"-> {run_dir.dataset_ref_path}"
        )
    if run_dir.dataset_path.is_file():
        return f"dataset: {count_rows(run_dir.dataset_path)} rows (the run's own) -> {run_dir.dataset_path}"
    return None


def dataset_rows(run_dir: RunDir, cfg: RunConfig) -> Path | Iterator[dict[str, Any]]:
    """What the bridge reads: the referenced file's rows (lazily) if the run has a reference, else
    its ``dataset.jsonl``.

    A referenced row gets the defaults a copy would hold (:func:`_filled_row`), and blank lines
    are skipped as the bridge skips them in a copy, so both give every row the same task index.
    A file that is gone or a line that no longer parses (the file changed under the run) is a
    :class:`ConfigError`.
    """
    if run_dir.dataset_ref_path.is_file():
        return _referenced_rows(cfg, _read_ref(run_dir).path)
    return run_dir.dataset_path


def _referenced_rows(cfg: RunConfig, path: Path) -> Iterator[dict[str, Any]]:
    try:
        f = path.open("rb")
    except OSError as exc:
        raise ConfigError(
            [f"data.path: cannot read the run's dataset {path}: {exc.strerror or exc}"]
        ) from exc
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                row = _filled_row(cfg, orjson.loads(line), where)
            except (ValueError, TypeError, KeyError) as exc:  # orjson's JSONDecodeError is a ValueError
                raise ConfigError(
                    [f"data.path: {where} is no longer the row the run checked at start-up ({exc!r})"]
                ) from exc
            yield row


def _read_ref(run_dir: RunDir) -> DatasetFile:
    try:
        return DatasetFile.from_json(orjson.loads(run_dir.dataset_ref_path.read_bytes()))
    except (OSError, ValueError) as exc:  # orjson.JSONDecodeError is a ValueError
        raise ResumeError(run_dir.path, f"{run_dir.dataset_ref_path} is unreadable: {exc}") from exc


def _file_digest(path: Path, progress: Progress | None) -> tuple[int, str] | None:
    """``(size in bytes, sha256 hex)`` of ``path``, read in 1 MiB chunks; ``None`` if it is missing."""
    digest = hashlib.sha256()
    size_bytes = 0
    report_at = PROGRESS_EVERY_BYTES
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return None
    with f:
        total = os.fstat(f.fileno()).st_size
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size_bytes += len(chunk)
            if progress is not None and size_bytes >= report_at:
                report_at += PROGRESS_EVERY_BYTES
                progress(f"dataset: checking {path}: {_size_text(size_bytes)} of {_size_text(total)}")
    return size_bytes, digest.hexdigest()


def _checked_lines(cfg: RunConfig, reader: DatasetReader) -> Iterator[bytes]:
    """The reader's rows as dataset lines, defaults filled in; raises the pass's problems at its end."""
    for lineno, row in reader:
        where = f"{reader.path} line {lineno}"
        unrouted = _route_problem(cfg, row, where)
        if unrouted is not None:
            reader.refuse(unrouted)
            continue
        try:
            yield _row_line(cfg, row, where)
        except ConfigError as exc:
            for problem in exc.problems:
                reader.refuse(problem)
    reader.result()


def _route_problem(cfg: RunConfig, row: dict[str, Any], where: str) -> str | None:
    """Why ``row`` names no environment the run has (``env.mix``: one of its labels; ``env.head_url``:
    an agent), or ``None``."""
    if not cfg.env.mix and cfg.env.head_url is None:
        return None
    from gymbridge.client import env_of_row

    name = env_of_row(row)
    if cfg.env.head_url is not None:
        if name is None:
            return (
                f"{where}: no agent_ref: with env.head_url every row names the agent that runs it "
                '(agent_ref: {"type": "responses_api_agents", "name": AGENT})'
            )
        return None
    labels = cfg.env.mix_labels
    if name is None:
        return (
            f"{where}: no agent_ref: with env.mix every row names its environment "
            f'(agent_ref: {{"type": "responses_api_agents", "name": one of {labels}}})'
        )
    if name not in labels:
        return f"{where}: agent_ref names {name!r}, not an environment of env.mix ({labels})"
    return None


def _filled_row(cfg: RunConfig, row: dict[str, Any], where: str) -> dict[str, Any]:
    """``row`` with the run's sampling settings filled in (module docstring); refuses other sampling."""
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
    return {**row, "responses_create_params": rcp}


def _row_line(cfg: RunConfig, row: dict[str, Any], where: str) -> bytes:
    """``row`` as a dataset line with the run's sampling settings filled in (:func:`_filled_row`)."""
    return orjson.dumps(_filled_row(cfg, row, where)) + b"\n"


def _size_text(size_bytes: int) -> str:
    """``size_bytes`` for a person: ``512 B``, ``1.2 MiB``, ``10.0 GiB``."""
    size = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size_bytes} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
