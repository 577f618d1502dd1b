"""Validation in a run's artifacts: the viewer's Validation panel (each pass listed, its rollouts loaded
when opened, its reward mean on the curve), the validation series on the charts, passes written once,
and a resumed run's validation series rebuilt from ``eval.jsonl``."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from test_artifacts import _browser, _dom, _js_arg, _record, _rows

from gymbridge.run import ArtifactsCallback, RunDir
from gymbridge.run import artifacts as artifacts_module
from gymbridge.run.artifacts import RunArtifacts
from gymbridge.safe_io import write_atomic

ENVS = ("color_pick", "counter")


def _metrics(base: float, k: int = 4) -> dict[str, float]:
    """NeMo Gym's pass@k keys (percentages) of a pass whose rollouts score ``base`` on average."""
    return {
        "pass@1/accuracy": 100 * base,
        f"pass@{k}/accuracy": 100 * min(1.0, base + 0.3),
        "pass@1[avg-of-1]/accuracy": 100 * base,
        f"pass@1[avg-of-{k}]/accuracy": 100 * base,
        f"pass@1[avg-of-{k}]/accuracy/std_dev_across_runs": 3.0,
        f"majority@{k}/accuracy": 100 * min(1.0, base + 0.1),
    }


def _reward(step: int) -> float:
    return round(0.1 + step / 100, 4)


def eval_record(step: int, envs: Iterable[str] = ENVS) -> dict[str, Any]:
    """An ``eval.jsonl`` line of the pass after step ``step`` (two prompts per environment, n=4)."""
    envs = list(envs)
    base = _reward(step)
    per_env = {
        name: {
            "prompts": 2,
            "rollouts_ok": 7,
            "rollouts_failed": 1,
            "reward_mean": round(base + i / 10, 4),
            "metrics": _metrics(base + i / 10),
        }
        for i, name in enumerate(envs)
    }
    return {
        "step": step,
        "policy_version": step,
        "when": "start" if step == 0 else "every",
        "prompts": 2 * len(envs),
        "n": 4,
        "temperature": 1.0,
        "rollouts_ok": 7 * len(envs),
        "rollouts_failed": len(envs),
        "elapsed_s": 3.2,
        "reward_mean": base,
        "metrics": _metrics(base),
        "env": per_env,
        "rollouts": f"eval/step_{step}.jsonl",
    }


def eval_rollouts(step: int, envs: Iterable[str] = ENVS) -> list[dict[str, Any]]:
    """The ``eval/step_<n>.jsonl`` lines of that pass: per environment 2 prompts x 4 rollouts, the
    last one failed."""
    out: list[dict[str, Any]] = []
    for e, env in enumerate(envs):
        for t in range(2):
            task = 2 * e + t
            for r in range(4):
                ok = not (t == 1 and r == 3)
                out.append(
                    {
                        "task_index": task,
                        "rollout_index": r,
                        "env": env,
                        "ok": ok,
                        "reward": (1.0 if r % 2 == 0 else 0.0) if ok else None,
                        "failure_class": None if ok else "HTTPError",
                        "failure_reason": None if ok else "503 from the environment",
                        "prompt_text": f"Which colour is square {task}?",
                        "output_text": f"step {step} says <b>red</b> {r}" if ok else "",
                        "answer": "red",
                    }
                )
    return out


def _eval_js(path: Path, function: str) -> Any:
    """The last JSON argument of ``GB_EVAL_INDEX(k, [...]);`` or ``GB_EVAL(n, {...});``."""
    text = path.read_text()
    assert text.startswith(function + "(") and text.endswith(");\n"), text[:200]
    return orjson.loads(text[len(function) + 1 : -3].partition(",")[2])


def _eval_index(path: Path) -> list[int]:
    """The passes the Validation panel lists, as the page reads them."""
    manifest = _js_arg(path / "viewer" / "data.js", "GB_MANIFEST")
    chunks = [path / "viewer" / "eval" / "index" / f"chunk_{k}.js" for k in range(manifest["eval_chunks"])]
    steps = [e["step"] for chunk in chunks if chunk.is_file() for e in _eval_js(chunk, "GB_EVAL_INDEX")]
    return [s for s in steps if s <= manifest["eval_last_step"]]


class _Charts:
    """What each chart drew: stem -> [(panel title, x limits, {line label: (xs, ys)})]."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.drawn: dict[
            str, list[tuple[str, tuple[float, float], dict[str, tuple[list[float], list[float]]]]]
        ] = {}
        real = RunArtifacts._save

        def spy(art: RunArtifacts, fig: Any, stem: str) -> Path:
            self.drawn[stem] = [
                (
                    ax.get_title(),
                    tuple(ax.get_xlim()),
                    {
                        line.get_label(): (
                            [float(x) for x in line.get_xdata()],
                            [float(y) for y in line.get_ydata()],
                        )
                        for line in ax.lines
                    },
                )
                for ax in fig.axes
                if ax.axison
            ]
            return real(art, fig, stem)

        monkeypatch.setattr(RunArtifacts, "_save", spy)


def _run(
    path: Path, passes: Iterable[int], steps: int, envs: Iterable[str] = ENVS, **kwargs: Any
) -> RunArtifacts:
    """A synthetic run: ``steps`` steps and a validation pass after each step of ``passes`` (0: before
    the first), in the order a run records them."""
    art = RunArtifacts(path, **kwargs)
    passes, envs = set(passes), list(envs)
    if 0 in passes:
        art.record_eval(eval_record(0, envs), eval_rollouts(0, envs))
    for step in range(1, steps + 1):
        art.write_step(step, _rows(step), _record(step), refresh=False)
        if step in passes:
            art.record_eval(eval_record(step, envs), eval_rollouts(step, envs))
    return art


# ---------------------------------------------------------------------- the page in Chromium


def test_validation_panel_lists_passes_and_renders_the_opened_pass_in_chromium(tmp_path: Path) -> None:
    _browser()  # skip early without chromium
    art = _run(tmp_path, passes=(0, 3, 6), steps=6)
    art.finish()
    assert (tmp_path / "charts" / "eval.png").is_file()

    dom = _dom((tmp_path / "viewer" / "index.html").as_uri() + "#eval-3")
    assert "Validation (3 passes)" in dom
    assert re.findall(r'<tr[^>]*data-eval="(\d+)"', dom) == ["0", "3", "6"]  # one row per pass...
    assert re.findall(r'data-eval-env="(\w+)"', dom) == [*ENVS] * 3  # ...and one per environment under it
    assert re.findall(r'<tr class="open" data-eval="(\d+)"', dom) == ["3"]
    for heading in ("reward mean", "pass@1[avg-of-4]/accuracy", "pass@4/accuracy", "majority@4/accuracy"):
        assert f"<th>{heading}</th>" in dom
    row_3 = re.search(r'<tr class="open" data-eval="3">(.*?)</tr>', dom)
    assert row_3 is not None
    assert re.findall(r"<td>([^<]*)</td>", row_3.group(1)) == [
        "3", "v3", "every", "all", "0.130", "13.0", "43.0", "23.0", "14", "2", "3.2",
    ]  # fmt: skip
    # the opened pass: only its file loaded, its 16 rollouts' prompt and output text (as text)
    assert 'data-eval-files="1"' in dom and 'data-step-files="0"' in dom
    assert '<section class="eval" id="eval-3">' in dom
    assert dom.count('class="eval-rollout ') == 16 and dom.count('class="eval-rollout fail"') == 2
    assert dom.count("step 3 says &lt;b&gt;red&lt;/b&gt;") == 14  # a failed rollout said nothing
    assert "step 6 says" not in dom
    assert "Which colour is square 2?" in dom and "answer: red" in dom
    assert "failure HTTPError: 503 from the environment" in dom
    # the curve: the training reward and the validation reward mean, a dot per pass
    assert len(re.findall(r"<polyline ", dom)) == 2
    assert re.findall(r'<circle [^>]*data-eval="(\d+)"', dom) == ["0", "3", "6"]
    assert 'class="step"' not in dom  # no training step opened with it


# ---------------------------------------------------------------------- files: written once, bounded


def test_a_pass_writes_its_file_once_and_rewrites_no_earlier_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[tuple[str, int]] = []

    def spy(path: str | Path, chunks: Iterable[bytes]) -> None:
        data = b"".join(chunks)
        written.append((Path(path).relative_to(tmp_path).as_posix(), len(data)))
        write_atomic(path, [data])

    monkeypatch.setattr(artifacts_module, "write_atomic", spy)
    art = RunArtifacts(tmp_path, index_chunk=4)
    monkeypatch.setattr(art, "draw_eval_charts", lambda: [])  # charts: constant size, tested below
    per_pass: dict[int, list[tuple[str, int]]] = {}
    before: dict[str, tuple[int, int, bytes]] = {}
    for step in range(1, 41):  # eval.every = 1
        art.write_step(step, _rows(step), _record(step), refresh=False)
        written.clear()
        art.record_eval(eval_record(step), eval_rollouts(step))
        per_pass[step] = list(written)
        if step == 3:
            before = {
                p.relative_to(tmp_path).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
                for p in tmp_path.glob("viewer/eval/0/*")
            }
    for step, files in per_pass.items():
        k = (step - 1) // 4
        assert sorted(p for p, _ in files) == sorted(
            [
                f"viewer/eval/{k}/step_{step}.js",
                f"viewer/eval/index/chunk_{k}.js",
                f"viewer/index/chunk_{k}.js",  # the step's summary, not yet flushed (refresh=False)
                "viewer/data.js",
            ]
            + (["viewer/index.html"] if step == 1 else [])
        ), step
    assert before and all(
        ((tmp_path / rel).stat().st_ino, (tmp_path / rel).stat().st_mtime_ns, (tmp_path / rel).read_bytes())
        == v
        for rel, v in before.items()
    )
    # bytes per pass do not grow with the run: pass 37 writes what pass 5 did, up to digits
    assert abs(sum(n for _, n in per_pass[37]) - sum(n for _, n in per_pass[5])) < 128
    assert _eval_index(tmp_path) == list(range(1, 41))
    pass_7 = _eval_js(tmp_path / "viewer" / "eval" / "1" / "step_7.js", "GB_EVAL")
    assert pass_7 == {"step": 7, "record": eval_record(7), "rollouts": eval_rollouts(7)}


def test_a_resumed_run_drops_the_passes_after_its_checkpoint_from_the_viewer(tmp_path: Path) -> None:
    _run(tmp_path, passes=(0, 2, 4, 6, 8), steps=9, index_chunk=4).write_viewer()
    assert _eval_index(tmp_path) == [0, 2, 4, 6, 8]
    # resumed from the checkpoint of step 3: step 4 again, then its pass
    resumed = RunArtifacts(tmp_path)
    resumed.write_step(4, _rows(4), _record(4), refresh=False)
    resumed.write_viewer()
    assert _eval_index(tmp_path) == [0, 2]
    resumed.record_eval({**eval_record(4), "reward_mean": 0.9}, eval_rollouts(4))
    assert _eval_index(tmp_path) == [0, 2, 4]
    entries = _eval_js(tmp_path / "viewer" / "eval" / "index" / "chunk_0.js", "GB_EVAL_INDEX")
    assert entries[-1]["reward_mean"] == 0.9


# ---------------------------------------------------------------------- charts


def test_charts_draw_the_validation_series_on_the_training_reward_step_axis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    charts = _Charts(monkeypatch)
    art = _run(tmp_path, passes=(0, 5, 10), steps=10)
    art.draw_charts()
    passes = [0.0, 5.0, 10.0]
    ((_, reward_xlim, reward),) = charts.drawn["env_reward"]
    assert reward["training"][0] == [float(s) for s in range(1, 11)]
    assert reward["validation"] == (passes, [_reward(s) for s in (0, 5, 10)])
    assert reward["validation counter"][1] == [round(_reward(s) + 0.1, 4) for s in (0, 5, 10)]
    assert reward_xlim[0] < 0 < 10 < reward_xlim[1]  # step 0's pass and the last step in view
    panels = {title: (xlim, lines) for title, xlim, lines in charts.drawn["eval"]}
    assert sorted(panels) == ["validation, all environments", "validation, color_pick", "validation, counter"]
    xlim, lines = panels["validation, all environments"]
    assert xlim == reward_xlim  # the same step axis as the training reward
    assert lines["pass@1[avg-of-4]/accuracy"] == (passes, [100 * _reward(s) for s in (0, 5, 10)])
    assert lines["pass@4/accuracy"][1] == [100 * min(1.0, _reward(s) + 0.3) for s in (0, 5, 10)]
    assert lines["majority@4/accuracy"][0] == passes
    assert panels["validation, counter"][1]["pass@1[avg-of-4]/accuracy"][1] == pytest.approx(
        [100 * (_reward(s) + 0.1) for s in (0, 5, 10)]
    )

    # one environment: one panel; no validation: no eval.png and the reward chart as it was
    charts.drawn.clear()
    _run(tmp_path / "one", passes=(2,), steps=2, envs=["color_pick"]).refresh()
    assert [title for title, _, _ in charts.drawn["eval"]] == ["validation, color_pick"]
    charts.drawn.clear()
    plain = _run(tmp_path / "none", passes=(), steps=2)
    assert "eval.png" not in [p.name for p in plain.draw_charts()]
    assert list(charts.drawn["env_reward"][0][2]) == ["training"]


def test_a_resumed_run_rebuilds_the_validation_series_from_eval_jsonl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    charts = _Charts(monkeypatch)
    run_dir = RunDir.create(tmp_path)
    run_dir.metrics_path.write_bytes(b"".join(orjson.dumps(_record(s)) + b"\n" for s in range(1, 7)))
    lines = b"".join(orjson.dumps(eval_record(s, ["color_pick"])) + b"\n" for s in (0, 3, 6))
    run_dir.eval_path.write_bytes(lines + b'{"step": 9, "rew')  # a line torn by a crash
    said: list[str] = []
    run = SimpleNamespace(
        say=said.append,
        run_dir=run_dir,
        model=SimpleNamespace(tokenizer=SimpleNamespace(decode=str)),
        config=SimpleNamespace(output=SimpleNamespace(chart_every=5)),
    )
    cb = ArtifactsCallback()
    cb.on_setup(run)  # type: ignore[arg-type]
    try:
        for step in (7, 8):
            cb.on_step(SimpleNamespace(step=step, batch=SimpleNamespace(groups=[])), _record(step))  # type: ignore[arg-type]
        cb.on_eval(eval_record(8, ["color_pick"]), eval_rollouts(8, ["color_pick"]))
        cb.on_end(SimpleNamespace())  # type: ignore[arg-type]
    finally:
        cb.close()
    assert list(cb._artifacts.eval_series.steps) == [0, 3, 6, 8]
    ((_, _, reward),) = charts.drawn["env_reward"]
    assert reward["validation"] == ([0.0, 3.0, 6.0, 8.0], [_reward(s) for s in (0, 3, 6, 8)])
    ((_, _, lines),) = charts.drawn["eval"]
    assert lines["pass@1[avg-of-4]/accuracy"][0] == [0.0, 3.0, 6.0, 8.0]
    # the viewer's list: the pass this run recorded (earlier ones are in the earlier attempt's index)
    assert _eval_index(tmp_path) == [8]
    assert (tmp_path / "viewer" / "eval" / "0" / "step_8.js").is_file()
