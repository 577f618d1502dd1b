"""Issue 42 ("long runs hold flat"): a run's dataset is streamed, never held whole.

``data.path`` is validated in one streaming pass and referred to (``dataset.ref.json``) instead of
copied; the bridge reads the file lazily and trains the rows a copy would give it; a resume
re-checks the file; generated rows are written as they are made. Each test drives the run's own
set-up phases (:class:`~gymbridge.run.GRPORun`'s run directory and data phases: no model, no
servers).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import tracemalloc
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from run_helpers import run_config

from gymbridge.bridge import BridgeConfig, BridgeIterator, read_rows
from gymbridge.bridge.sources import RolloutRecord
from gymbridge.errors import BridgeStalledError, ConfigError, ResumeError
from gymbridge.run import GRPORun, RunConfig, RunDir
from gymbridge.run.callbacks import Callback
from gymbridge.run.data import (
    MAX_NAMED_PROBLEMS,
    DatasetReader,
    resume_dataset,
    write_dataset,
    write_run_dataset,
)
from gymbridge.run.userenv import read_dataset
from gymbridge.trainer.checkpoint import FORMAT, LATEST


class Said(Callback):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def on_message(self, text: str) -> None:
        self.lines.append(text)


def row(i: int, **rcp: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": f"question {i}", **rcp}, "answer": i}


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def set_up_data(cfg: RunConfig, resume: str = "never") -> tuple[GRPORun, list[str]]:
    """The run's phases up to its dataset (run directory, environment, data)."""
    said = Said()
    run = GRPORun(cfg, callbacks=[said], resume=resume)  # type: ignore[arg-type]
    run._setup_run_dir()
    run._setup_data(run._resolve_env())
    return run, said.lines


def checkpointed(run_dir: Path) -> None:
    """Make ``run_dir`` look checkpointed at step 1 (a resume then gets to its data phase)."""
    pointer = {"format": FORMAT, "step": 1, "state": "step-1.ckpt", "kind": "file"}
    (run_dir / "checkpoints" / LATEST).write_bytes(orjson.dumps(pointer))


class RecordingSource:
    """Records the row of each task the bridge starts; every rollout fails (no model needed)."""

    def __init__(self) -> None:
        self.rows: dict[int, Mapping[str, Any]] = {}

    async def rollouts(
        self, row: Mapping[str, Any], *, task_index: int, group_size: int
    ) -> list[RolloutRecord]:
        self.rows[task_index] = row
        return [
            RolloutRecord(task_index, i, failure_class="test", failure_reason="no model")
            for i in range(group_size)
        ]

    async def aclose(self) -> None:
        pass


async def rows_the_bridge_starts(run: GRPORun, n: int) -> dict[int, Mapping[str, Any]]:
    source = RecordingSource()
    config = BridgeConfig(
        group_size=1, prompts_per_step=n + 1, min_group_size=1, max_consecutive_failed_groups=n + 1
    )
    bridge = BridgeIterator(run.run_dir.dataset_rows(run.config), source, None, config)
    with pytest.raises(BridgeStalledError, match="without a single completed group"):
        await bridge.next_batch()
    return source.rows


async def test_a_dataset_path_is_referenced_and_the_bridge_starts_the_rows_a_copy_gives(
    tmp_path: Path,
) -> None:
    lines = [
        orjson.dumps(row(0)),
        b"",  # blank lines are no rows and take no task index
        orjson.dumps(row(1, max_output_tokens=7)),
        b"   ",
        orjson.dumps(row(2, temperature=1.0, top_p=0.9)),
        orjson.dumps(row(3)),
    ]
    rows = write_lines(tmp_path / "rows.jsonl", lines)
    settings = {"data.path": str(rows), "trainer.top_p": 0.9}
    by_ref, said = set_up_data(run_config(tmp_path / "ref", settings))
    ref_dir = by_ref.run_dir
    assert not ref_dir.dataset_path.exists()
    assert orjson.loads(ref_dir.dataset_ref_path.read_bytes()) == {
        "path": str(rows),  # tmp_path is absolute
        "size": rows.stat().st_size,
        "sha256": hashlib.sha256(rows.read_bytes()).hexdigest(),
        "rows": 4,
    }
    assert said[-1].startswith(f"dataset: 4 rows (from {rows}) by reference: ")
    assert hashlib.sha256(rows.read_bytes()).hexdigest()[:12] in said[-1]

    copied, said = set_up_data(run_config(tmp_path / "copy", {**settings, "data.copy_rows": True}))
    assert copied.run_dir.dataset_path.is_file() and not copied.run_dir.dataset_ref_path.exists()
    assert said[-1] == f"dataset: 4 rows (from {rows}) -> {copied.run_dir.dataset_path}"

    from_ref = await rows_the_bridge_starts(by_ref, 4)
    from_copy = await rows_the_bridge_starts(copied, 4)
    assert sorted(from_ref) == sorted(from_copy) == [0, 1, 2, 3]
    assert from_ref == from_copy
    filled = [r["responses_create_params"] for _, r in sorted(from_ref.items())]
    assert [(p["max_output_tokens"], p["temperature"], p["top_p"]) for p in filled] == [
        (by_ref.config.rollout.max_tokens, 1.0, 0.9),
        (7, 1.0, 0.9),
        (by_ref.config.rollout.max_tokens, 1.0, 0.9),
        (by_ref.config.rollout.max_tokens, 1.0, 0.9),
    ]
    assert [r["answer"] for _, r in sorted(from_ref.items())] == [0, 1, 2, 3]
    assert rows.read_bytes() == b"".join(line + b"\n" for line in lines)  # the user's file is untouched


def big_rows(path: Path, n: int, image_bytes: int) -> Path:
    """``n`` rows, each with a distinct base64 image of ``image_bytes`` (a few tens of MB in all)."""
    with path.open("wb") as f:
        for i in range(n):
            image = "data:image/png;base64," + base64.b64encode(os.urandom(image_bytes)).decode()
            content = [
                {"type": "input_text", "text": f"task {i}"},
                {"type": "input_image", "image_url": image},
            ]
            f.write(
                orjson.dumps({"responses_create_params": {"input": [{"role": "user", "content": content}]}})
            )
            f.write(b"\n")
    return path


def test_the_validation_pass_and_the_reads_keep_memory_flat(tmp_path: Path) -> None:
    rows = big_rows(tmp_path / "rows.jsonl", 300, 75_000)  # ~30 MB, 100 kB a line
    size = rows.stat().st_size
    cfg = run_config(tmp_path / "run", {"data.path": str(rows)})
    run_dir = RunDir.create(tmp_path / "run")
    read_dataset(big_rows(tmp_path / "small.jsonl", 2, 10))  # imports done before measuring
    tracemalloc.start()
    try:
        line = write_run_dataset(cfg, None, run_dir)  # the start-up pass
        _, start_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        assert resume_dataset(run_dir) is not None  # the resume's re-check
        _, resume_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        read = sum(1 for _ in read_rows(run_dir.dataset_rows(cfg)))  # what the bridge reads
        _, read_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert line.startswith("dataset: 300 rows") and read == 300
    # a whole-file read peaks at the file's size at least; a streamed one at a few lines
    assert max(start_peak, resume_peak, read_peak) < size / 10, (start_peak, resume_peak, read_peak, size)


def test_every_bad_line_is_named_up_to_the_cap_then_counted(tmp_path: Path) -> None:
    bad = 25
    lines = [orjson.dumps(row(0))] + [b"{not json"] * bad + [b"[1, 2]", orjson.dumps(row(1))]
    rows = write_lines(tmp_path / "rows.jsonl", lines)
    with pytest.raises(ConfigError) as err:
        set_up_data(run_config(tmp_path / "run", {"data.path": str(rows)}))
    problems = err.value.problems
    assert len(problems) == MAX_NAMED_PROBLEMS + 1
    assert [p.split(": ")[0] for p in problems[:-1]] == [
        f"{rows}:{n}" for n in range(2, 2 + MAX_NAMED_PROBLEMS)
    ]
    assert problems[-1] == f"and {bad + 1 - MAX_NAMED_PROBLEMS} more bad line(s)"  # the list counts too
    assert not (tmp_path / "run" / "dataset.ref.json").exists()


def test_a_row_asking_for_another_temperature_is_refused_with_the_bad_lines(tmp_path: Path) -> None:
    lines = [orjson.dumps(row(0)), b"{not json", orjson.dumps(row(1, temperature=0.5))]
    rows = write_lines(tmp_path / "rows.jsonl", lines)
    for copy_rows in (False, True):
        run_dir = tmp_path / f"run-{copy_rows}"
        with pytest.raises(ConfigError) as err:
            set_up_data(run_config(run_dir, {"data.path": str(rows), "data.copy_rows": copy_rows}))
        assert err.value.problems[0].startswith(f"{rows}:2: not JSON")
        assert err.value.problems[1] == (
            f"trainer.temperature: {rows} line 3 asks for temperature=0.5 but the trainer scores with "
            "temperature=1.0: the importance ratio would be biased; set trainer.temperature to the rows' "
            "value"
        )
        assert not (run_dir / "dataset.ref.json").exists() and not (run_dir / "dataset.jsonl").exists()


@pytest.mark.parametrize("content", [b"", b"\n  \n"])
def test_a_dataset_without_rows_is_refused(tmp_path: Path, content: bytes) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(content)
    with pytest.raises(ConfigError, match="holds no rows"):
        set_up_data(run_config(tmp_path / "run", {"data.path": str(rows)}))


def test_a_resume_refuses_a_referenced_file_that_changed_or_moved(tmp_path: Path) -> None:
    rows = write_lines(tmp_path / "rows.jsonl", [orjson.dumps(row(i)) for i in range(3)])
    cfg = run_config(tmp_path / "run", {"data.path": str(rows)})
    run, _ = set_up_data(cfg)
    checkpointed(run.run_dir.path)
    began = hashlib.sha256(rows.read_bytes()).hexdigest()

    _, said = set_up_data(cfg, resume="must")  # unchanged: it goes on
    assert said[-1].startswith("dataset: 3 rows (from ") and "by reference, unchanged" in said[-1]

    original = rows.read_bytes()
    rows.write_bytes(original.replace(b"question 1", b"question 7"))  # one byte, same size
    changed = hashlib.sha256(rows.read_bytes()).hexdigest()
    with pytest.raises(ResumeError) as err:
        set_up_data(cfg, resume="must")
    message = str(err.value)
    assert str(rows) in message and began in message and changed in message
    assert f"found {len(original)} bytes" in message and f"began with {len(original)} bytes" in message

    rows.write_bytes(original)
    rows.rename(tmp_path / "moved.jsonl")
    with pytest.raises(ResumeError, match=rf"{re.escape(str(rows))} is missing.*{began}"):
        set_up_data(cfg, resume="must")

    (tmp_path / "moved.jsonl").rename(rows)
    _, said = set_up_data(cfg, resume="must")  # put back: it goes on
    assert "by reference, unchanged" in said[-1]


def test_a_resume_keeps_a_copied_dataset_as_it_is(tmp_path: Path) -> None:
    rows = write_lines(tmp_path / "rows.jsonl", [orjson.dumps(row(i)) for i in range(3)])
    cfg = run_config(tmp_path / "run", {"data.path": str(rows), "data.copy_rows": True})
    run, _ = set_up_data(cfg)
    checkpointed(run.run_dir.path)
    copy = run.run_dir.dataset_path.read_bytes()
    rows.unlink()  # a copy does not need the file any more
    _, said = set_up_data(cfg, resume="must")
    assert said[-1] == f"dataset: 3 rows (the run's own) -> {run.run_dir.dataset_path}"
    assert run.run_dir.dataset_path.read_bytes() == copy


def old_generated_lines(cfg: RunConfig, spec: Any, n: int) -> bytes:
    """The rows as the list-building implementation wrote them (before issue 42)."""
    out = []
    for generated in list(spec.generate(n, cfg.seed, **cfg.env.params)):
        rcp = dict(generated["responses_create_params"])
        rcp.setdefault("max_output_tokens", cfg.rollout.max_tokens)
        rcp.setdefault("temperature", cfg.trainer.temperature)
        if cfg.trainer.top_p != 1.0:
            rcp.setdefault("top_p", cfg.trainer.top_p)
        out.append(orjson.dumps({**generated, "responses_create_params": rcp}) + b"\n")
    return b"".join(out)


def test_a_generated_dataset_is_written_whole_as_before(tmp_path: Path) -> None:
    cfg = run_config(tmp_path / "run", {"steps": 3, "bridge.prompts_per_step": 2, "seed": 5})
    run, said = set_up_data(cfg)
    path = run.run_dir.dataset_path
    assert path.read_bytes() == old_generated_lines(cfg, run._resolve_env(), 6)
    assert said[-1] == f"dataset: 6 rows (color_pick, generated) -> {path}"
    assert not run.run_dir.dataset_ref_path.exists()


class LazySpec:
    """A generator that checks, as it makes each row, that the rows before the last are gone."""

    def __init__(self) -> None:
        self.made = 0
        self.most_alive = 0

    def check_params(self, params: dict[str, Any]) -> dict[str, Any]:
        return params

    def generate(self, n: int, seed: int, **params: Any) -> Iterator[dict[str, Any]]:
        class Row(dict[str, Any]):
            pass

        alive: list[weakref.ref[Row]] = []
        for i in range(n):
            alive = [r for r in alive if r() is not None]
            self.most_alive = max(self.most_alive, len(alive))
            made = Row(responses_create_params={"input": f"q{i}"}, pad="x" * 1000)
            alive.append(weakref.ref(made))
            self.made += 1
            yield made


def test_generated_rows_are_written_as_they_are_made(tmp_path: Path) -> None:
    cfg = run_config(tmp_path / "run", {"steps": 50, "bridge.prompts_per_step": 4})
    spec = LazySpec()
    n, origin = write_dataset(cfg, spec, tmp_path / "dataset.jsonl")
    assert n == spec.made == 200 and origin == "color_pick, generated"
    assert spec.most_alive <= 2  # the row being written and the one before; a list holds all 200
    assert (tmp_path / "dataset.jsonl").read_bytes() == old_generated_lines(cfg, LazySpec(), 200)


def test_a_generator_that_fails_midway_leaves_no_dataset(tmp_path: Path) -> None:
    class Failing(LazySpec):
        def generate(self, n: int, seed: int, **params: Any) -> Iterator[dict[str, Any]]:
            yield row(0)
            raise ValueError("bad parameter")

    cfg = run_config(tmp_path / "run", {"steps": 2})
    with pytest.raises(ConfigError, match="color_pick generator: bad parameter"):
        write_dataset(cfg, Failing(), tmp_path / "dataset.jsonl")
    assert not (tmp_path / "dataset.jsonl").exists()


def test_a_long_pass_reports_its_progress(tmp_path: Path) -> None:
    rows = big_rows(tmp_path / "rows.jsonl", 10, 3_000)  # ~40 kB
    said: list[str] = []
    reader = DatasetReader(rows, progress=said.append, progress_every_bytes=10_000)
    assert [lineno for lineno, _ in reader] == list(range(1, 11))
    assert len(reader.result()) == 10
    size = rows.stat().st_size
    assert len(said) == size // 10_000 and said[0].startswith(f"dataset: checking {rows}: ")
    assert said[-1].endswith(" rows so far") and f"of {size / 1024:.1f} KiB" in said[-1]
