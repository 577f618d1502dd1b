"""What a user looks at after a run: rollouts/, media/, charts/ and a viewer that renders in Chromium,
pages by step (a 10,000-step run opens as fast as a 2-step one) and writes nothing twice."""

from __future__ import annotations

import io
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pytest
from PIL import Image
from run_helpers import run_config

from gymbridge.run import ArtifactsCallback, RunDir, train
from gymbridge.run import artifacts as artifacts_module
from gymbridge.run.artifacts import CHARTS, MAX_CHART_POINTS, ChartSeries, RunArtifacts, downsample
from gymbridge.safe_io import write_atomic

SMALL = {
    "steps": 2,
    "bridge.prompts_per_step": 2,
    "bridge.group_size": 2,
    "warmup.steps": 4,
    "output.chart_every": 1,
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("artifacts") / "run"
    out = io.StringIO()
    train(run_config(path, SMALL), out=out)
    lines = out.getvalue().strip().splitlines()
    assert lines[0] == f"run dir: {path}"  # printed first
    assert lines[-2:] == [f"charts: {path / 'charts'}/", f"viewer: {path / 'viewer' / 'index.html'}"]  # last
    return path


@pytest.mark.integration
def test_rollouts_of_every_step_with_turns_rewards_and_media_by_key(run_dir: Path) -> None:
    for step in (1, 2):
        rows = [
            orjson.loads(x) for x in (run_dir / "rollouts" / f"step_{step}.jsonl").read_bytes().splitlines()
        ]
        assert len(rows) == 4  # 2 prompts x G=2
        for r in rows:
            assert r["reward"] in (0.0, 1.0) and r["advantage"] is not None
            (turn,) = r["turns"]
            assert turn["generated_tokens"] == len(turn["generation_token_ids"]) > 0
            # the sampler's logprob of each generated token (a policy's confidence, per turn)
            assert len(turn["generation_logprobs"]) == turn["generated_tokens"]
            assert all(lp <= 0.0 for lp in turn["generation_logprobs"])
            assert isinstance(turn["text"], str)
            (media,) = turn["media"]
            assert (run_dir / media["path"]).is_file()
            assert media["path"] == f"media/{media['key']}.png"
            assert Image.open(run_dir / media["path"]).size == (56, 56)
        # the viewer's file of the step holds the same records and the step's metrics line
        step_file = _js_arg(run_dir / "viewer" / "steps" / "0" / f"step_{step}.js", "GB_STEP")
        assert step_file["rollouts"] == rows and step_file["metrics"]["step"] == step
    # each distinct image once on disk, however many rollouts show it
    assert len(list((run_dir / "media").iterdir())) <= 2


@pytest.mark.integration
def test_charts_are_pngs(run_dir: Path) -> None:
    for stem in [*CHARTS, "payload", "timing"]:
        with Image.open(run_dir / "charts" / f"{stem}.png") as img:
            assert img.format == "PNG" and img.width >= 300


# ---------------------------------------------------------------------- helpers


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _browser() -> list[str]:
    browser = _chromium()
    if browser is None:
        if os.environ.get("GYMBRIDGE_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium is required (CI): scripts/test.sh installs it with apt-get")
        pytest.skip("chromium is not installed (scripts/test.sh installs it)")
    return [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]


def _dom(url: str) -> str:
    """The page's DOM once its scripts ran (headless Chromium, from file://)."""
    dom = subprocess.run(
        [*_browser(), "--virtual-time-budget=5000", "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert 'data-ready="1"' in dom, dom[:2000]  # the script ran to the end
    return dom


def _js_arg(path: Path, function: str) -> Any:
    """The JSON argument of a viewer script ``function(..., {...});`` (the last one)."""
    text = path.read_text()
    assert text.startswith(function + "(") and text.endswith(");\n"), text[:200]
    body = text[len(function) + 1 : -3]
    if function in ("GB_INDEX", "GB_STEP"):
        body = body.partition(",")[2]
    return orjson.loads(body)


def _index(path: Path) -> list[int]:
    """The steps the viewer lists, as the page reads them: every chunk the manifest names (a
    missing one shows no step), up to its last step."""
    manifest = _js_arg(path / "viewer" / "data.js", "GB_MANIFEST")
    chunks = [path / "viewer" / "index" / f"chunk_{k}.js" for k in range(manifest["chunks"])]
    steps = [entry["step"] for chunk in chunks if chunk.is_file() for entry in _js_arg(chunk, "GB_INDEX")]
    return [s for s in steps if s <= manifest["last_step"]]


def _rows(step: int, text: str | None = None) -> list[dict[str, Any]]:
    """A step's rollout records as :meth:`RunArtifacts.rollout_records` makes them: one rollout of
    one turn, and one failed group."""
    turn = {
        "index": 0,
        "kind": "generation",
        "segment": 0,
        "prompt_tokens": 3,
        "generated_tokens": 2,
        "generation_token_ids": [7, step],
        "generation_logprobs": [-0.5, -0.25],
        "text": f"answer of step {step}" if text is None else text,
        "tool_names": [],
        "policy_version": step,
        "media": [],
    }
    rollout = {
        "group": 0,
        "task_index": 0,
        "rollout_index": 0,
        "reward": 1.0,
        "advantage": 0.5,
        "turns": [turn],
    }
    return [rollout, {"group": 1, "task_index": 1, "failure": {"failure_class": "HTTPError"}}]


def _record(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "env_reward_mean": (step % 10) / 10,
        "loss": 0.1,
        "step_s": 0.5,
        "timing/other": 0.5,
    }


def _plain_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Write without fsync (a synthetic run of thousands of steps in a second or two)."""

    def write(path: str | Path, chunks: Iterable[bytes]) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(b"".join(chunks))

    monkeypatch.setattr(artifacts_module, "write_atomic", write)


# ---------------------------------------------------------------------- the viewer in Chromium


@pytest.mark.integration
def test_viewer_renders_rollouts_turns_and_images_in_headless_chromium(run_dir: Path, tmp_path: Path) -> None:
    url = (run_dir / "viewer" / "index.html").as_uri()
    for opened in ("#step-1", ""):  # "": the last step, step 2
        dom = _dom(url + opened)
        assert dom.count('class="rollout ') == 4  # the opened step's 4 rollouts, not every step's
        assert dom.count('class="turn"') == 4
        assert dom.count('src="../media/') == 4 and "advantage" in dom and "reward" in dom
        assert f'id="step-{opened.removeprefix("#step-") or 2}"' in dom
        assert 'data-step-files="1"' in dom  # the opened step's file only
        assert re.findall(r'<tr[^>]*data-step="(\d+)"', dom) == ["1", "2"]  # the step list
    shot = tmp_path / "viewer.png"
    subprocess.run(
        [*_browser(), "--virtual-time-budget=5000", f"--screenshot={shot}", "--window-size=1000,1400", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    pixels = Image.open(shot).convert("RGB")
    colours = {c for _, c in pixels.getcolors(1 << 20) or []}
    # the rollouts' images rendered: the solid red / blue of color_pick appear in the screenshot
    from gymbridge_envs.color_pick.data import COLORS

    assert colours & {COLORS["red"], COLORS["blue"]}, "no rollout image rendered"


def test_viewer_of_10000_steps_lists_them_and_loads_only_the_opened_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _browser()  # skip early without chromium
    _plain_writes(monkeypatch)
    art = RunArtifacts(tmp_path / "run")
    for step in range(1, 10_001):
        text = "a </script><b>bold?</b> answer" if step == 9876 else None
        art.write_step(step, _rows(step, text), _record(step), refresh=False)
    art.write_viewer()
    assert len(_index(tmp_path / "run")) == 10_000
    assert b"</" not in art.step_path(9876).read_bytes()  # escaped (<\/): the file could be inlined as is

    dom = _dom((tmp_path / "run" / "viewer" / "index.html").as_uri() + "#step-9876")
    assert "10000 steps (last: 10000)" in dom
    assert 'data-step-files="1"' in dom  # one step's file loaded, of 10,000
    assert 'data-chunk-files="40"' in dom  # 10,000 / 250 summaries a chunk
    assert '<section class="step" id="step-9876">' in dom
    # its rollout and its failed group; the text shown as text, not markup
    assert dom.count('class="rollout ') == 1 and dom.count('class="failure"') == 1
    assert "a &lt;/script&gt;&lt;b&gt;bold?&lt;/b&gt; answer" in dom
    # the step list shows the page of step 9876 (100 steps), not 10,000 rows
    listed = [int(s) for s in re.findall(r'<tr[^>]*data-step="(\d+)"', dom)]
    assert listed == list(range(9801, 9901))
    assert re.findall(r'<tr class="open" data-step="(\d+)"', dom) == ["9876"]
    (points,) = re.findall(r'<polyline points="([^"]*)"', dom)
    assert 100 < len(points.split()) <= 900  # the reward curve: one point per pixel column at most


# ---------------------------------------------------------------------- flat writes, bounded memory


def test_recording_a_step_rewrites_no_earlier_step_and_writes_constant_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[tuple[str, int]] = []
    real = write_atomic

    def spy(path: str | Path, chunks: Iterable[bytes]) -> None:
        data = b"".join(chunks)
        written.append((Path(path).relative_to(tmp_path).as_posix(), len(data)))
        real(path, [data])

    monkeypatch.setattr(artifacts_module, "write_atomic", spy)
    art = RunArtifacts(tmp_path, chart_every=1, index_chunk=4)
    monkeypatch.setattr(art, "draw_charts", lambda series=None: [])  # charts: constant size, drawn elsewhere
    per_step: dict[int, list[tuple[str, int]]] = {}
    before: dict[str, tuple[int, int, bytes]] = {}
    for step in range(1, 41):
        written.clear()
        art.write_step(step, _rows(step), _record(step))  # refreshes the viewer at every step
        per_step[step] = list(written)
        if step == 3:
            before = {
                p.relative_to(tmp_path).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
                for p in [*tmp_path.glob("rollouts/*"), *tmp_path.glob("viewer/steps/*/*")]
            }
    # what step n writes: its own two files, its index chunk, the manifest; the page once
    for step, files in per_step.items():
        k = (step - 1) // 4
        expected = {
            f"rollouts/step_{step}.jsonl",
            f"viewer/steps/{k}/step_{step}.js",
            f"viewer/index/chunk_{k}.js",
        }
        expected |= {"viewer/data.js"} | ({"viewer/index.html"} if step == 1 else set())
        assert sorted(p for p, _ in files) == sorted(expected), step
    # earlier steps' files untouched: same inode, same modification time, same bytes
    for rel, (ino, mtime, data) in before.items():
        st = (tmp_path / rel).stat()
        assert (st.st_ino, st.st_mtime_ns, (tmp_path / rel).read_bytes()) == (ino, mtime, data), rel
    # bytes per step do not grow with the run: step 37 writes what step 5 did (4 chunks later),
    # up to the digits of the larger step numbers
    assert sum(n for _, n in per_step[37]) - sum(n for _, n in per_step[5]) < 64
    manifest_sizes = [n for files in per_step.values() for p, n in files if p == "viewer/data.js"]
    assert max(manifest_sizes) - min(manifest_sizes) <= 2
    assert _index(tmp_path) == list(range(1, 41))


def test_a_resumed_run_continues_the_index_without_reading_earlier_rollouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = RunArtifacts(tmp_path, index_chunk=4)
    for step in range(1, 11):
        first.write_step(step, _rows(step), _record(step), refresh=False)
    first.write_viewer()
    for f in (tmp_path / "rollouts").iterdir():  # nothing of earlier steps is read back...
        f.unlink()
    read: list[str] = []
    real = Path.read_bytes

    def spy(path: Path) -> bytes:
        read.append(os.path.relpath(path, tmp_path))
        return real(path)

    monkeypatch.setattr(Path, "read_bytes", spy)
    resumed = RunArtifacts(tmp_path)  # ...but the manifest and the newest index chunk
    monkeypatch.undo()
    assert read == ["viewer/data.js", "viewer/index/chunk_2.js"]
    assert resumed.index_chunk == 4  # the layout on disk, whatever the default
    for step in (11, 12, 13):
        resumed.write_step(step, _rows(step), _record(step), refresh=False)
    resumed.write_viewer()
    assert _index(tmp_path) == list(range(1, 14))
    assert _js_arg(tmp_path / "viewer" / "steps" / "0" / "step_2.js", "GB_STEP")["rollouts"] == _rows(2)

    # a run resumed from the checkpoint of step 6 records step 7 again: 8..13 leave the list
    again = RunArtifacts(tmp_path)
    again.write_step(7, _rows(7, "second try"), _record(7), refresh=False)
    again.write_viewer()
    assert _index(tmp_path) == list(range(1, 8))
    step_7 = _js_arg(tmp_path / "viewer" / "steps" / "1" / "step_7.js", "GB_STEP")
    assert step_7["rollouts"][0]["turns"][0]["text"] == "second try"


# ---------------------------------------------------------------------- charts


def _plotted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of points of every line and stack the charts draw."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    points: list[int] = []
    plot, stackplot = Axes.plot, Axes.stackplot

    def spy_plot(self: Axes, x: Any, *args: Any, **kwargs: Any) -> Any:
        points.append(len(x))
        return plot(self, x, *args, **kwargs)

    def spy_stack(self: Axes, x: Any, *args: Any, **kwargs: Any) -> Any:
        points.append(len(x))
        return stackplot(self, x, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy_plot)
    monkeypatch.setattr(Axes, "stackplot", spy_stack)
    return points


def _long_records(steps: int) -> list[dict[str, Any]]:
    return [
        {
            **_record(s),
            "timing/wait_rollouts": 0.25,
            "payload": {"bridge_to_trainer": {"serialized_bytes": 1000 + s}},
        }
        for s in range(1, steps + 1)
    ]


def test_charts_plot_a_bounded_number_of_points_however_long_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    points = _plotted(monkeypatch)
    art = RunArtifacts(tmp_path, series=ChartSeries.from_records(_long_records(10_000)))
    paths = art.draw_charts()
    assert sorted(p.name for p in paths) == sorted(f"{stem}.png" for stem in [*CHARTS, "payload", "timing"])
    # 4 metric charts, one payload line, the timing stack and its step_s line: each downsampled
    assert len(points) == 7 and set(points) == {MAX_CHART_POINTS}
    points.clear()
    RunArtifacts(tmp_path / "short", series=ChartSeries.from_records(_long_records(500))).draw_charts()
    assert set(points) == {500}  # below the bound: every step


def test_downsample_averages_runs_of_steps_and_keeps_gaps() -> None:
    x = np.arange(1.0, 10_001.0)
    y = np.sin(x / 300.0)
    y[4000:4600] = np.nan  # steps with no value (e.g. a metric not recorded then)
    xs, ys = downsample(x, y, 100)
    assert len(xs) == len(ys) == 100
    # the reference: mean of each consecutive run of 100 steps, NaNs left out
    ref = [
        np.nanmean(y[i : i + 100]) if np.isfinite(y[i : i + 100]).any() else np.nan
        for i in range(0, 10_000, 100)
    ]
    np.testing.assert_allclose(ys, np.array(ref), equal_nan=True)
    np.testing.assert_allclose(xs, x.reshape(100, 100).mean(axis=1))
    assert np.isnan(ys[40:46]).all() and np.isfinite(ys[39]) and np.isfinite(ys[46])
    short = np.arange(5.0)
    assert downsample(short, short, 100)[1] is short


def test_chart_series_of_a_resumed_run_are_read_from_metrics_jsonl_a_line_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = RunDir.create(tmp_path)
    lines = b"".join(orjson.dumps(r) + b"\n" for r in _long_records(300))
    run_dir.metrics_path.write_bytes(lines + b'{"step": 301, "lo')  # a line torn by a crash

    def whole_file(self: RunDir) -> list[dict[str, Any]]:
        raise AssertionError("the callback parsed every record of metrics.jsonl at once")

    monkeypatch.setattr(RunDir, "metrics", whole_file)
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
        for step in (301, 302):
            cb.on_step(SimpleNamespace(step=step, batch=SimpleNamespace(groups=[])), _record(step))  # type: ignore[arg-type]
        cb.on_end(SimpleNamespace())  # type: ignore[arg-type]
    finally:
        cb.close()
    series = cb._artifacts.series
    assert list(series.steps) == list(range(1, 303))
    assert list(series.values["payload/bridge_to_trainer"])[:300] == [1000.0 + s for s in range(1, 301)]
    assert math.isnan(series.values["payload/bridge_to_trainer"][301])  # steps 301-302 had none
    assert list(series.values["env_reward_mean"])[-2:] == [0.1, 0.2]
    assert said == [f"charts: {tmp_path / 'charts'}/\nviewer: {tmp_path / 'viewer' / 'index.html'}"]
    assert _index(tmp_path) == [301, 302]  # the viewer's index: the steps this run recorded
