"""What a user looks at in a run directory: per-step rollouts, their media, charts and a static viewer.

Layout (next to :mod:`gymbridge.run.rundir`'s files; ``C`` is the index chunk size, :data:`INDEX_CHUNK`,
and step n's chunk is ``k = (n - 1) // C``)::

    DIR/rollouts/step_<n>.jsonl       one JSON object per rollout of step n (every group, failed ones too)
    DIR/media/<key>.<ext>             each media item once, named by its content key
    DIR/charts/*.png                  env reward, loss, ratio, grad norm per step; payload bytes per boundary;
                                      timing.png: each step's seconds split by phase (``timing/*``)
    DIR/viewer/index.html             a static page: open it from disk (it loads scripts, never fetches)
    DIR/viewer/data.js                the manifest: GB_MANIFEST({title, chunk_size, chunks, last_step})
    DIR/viewer/index/chunk_<k>.js     GB_INDEX(k, [...]): a summary of each step of chunk k (step, headline
                                      metrics, ok / failed rollouts)
    DIR/viewer/steps/<k>/step_<n>.js  GB_STEP(n, {step, metrics, rollouts}): step n's rollout records (those
                                      of rollouts/step_<n>.jsonl) and its metrics.jsonl record

The page lists the steps (a page of them at a time) and draws the env reward curve from the index
chunks, and loads a step's file only when it is opened (``index.html#step-<n>``; the last step by
default). A rollout record holds ``task_index``, ``rollout_index``, ``reward``, ``advantage``
(``None`` when the group was not trained), ``reward_components``, failure fields and its
``turns``: each turn's kind, prompt / generated token counts, the generated token ids and text,
its policy version and its media as ``{"key", "modality", "path"}`` (``path`` relative to DIR).
A group that failed adds one record per failure (``failure: {...}``, no turns).

Invariants:

* no file grows with the run's length; earlier steps are never rewritten. A step writes its
  rollouts file and its step file once; a refresh (step 1, every ``chart_every`` steps, the end)
  rewrites the newest index chunk (at most C summaries), the manifest and the charts, whose
  series are averaged down to at most :data:`MAX_CHART_POINTS` points;
* memory does not hold earlier steps: :class:`RunArtifacts` keeps one index chunk and the chart
  series (:class:`ChartSeries`, 8 bytes per step and plotted key); a resumed run reads back only
  the manifest and the newest index chunk (re-recording step n drops the summaries of n and later);
* media are written once per content key (the same image in many rollouts or steps is one file);
  every file is written atomically, so a viewer or chart read mid-run sees a whole file, and a
  step's file is on disk before the index names it; JSON in a script has ``</`` escaped;
* charts are drawn with matplotlib's non-interactive Agg backend (the ``train`` extra; without
  matplotlib the charts are skipped with one warning, everything else is still written);
  nothing here changes training.
"""

from __future__ import annotations

import bisect
import html
import logging
import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from gymbridge.safe_io import write_atomic

if TYPE_CHECKING:
    import numpy as np

    from gymbridge.bridge import GroupResult
    from gymbridge.media import MediaItem
    from gymbridge.trajectory import Trajectory

logger = logging.getLogger(__name__)

__all__ = ["CHARTS", "INDEX_CHUNK", "MAX_CHART_POINTS", "ChartSeries", "RunArtifacts", "downsample"]

CHARTS: dict[str, tuple[str, str]] = {
    "env_reward": ("env_reward_mean", "mean environment reward"),
    "loss": ("loss", "GRPO loss"),
    "ratio": ("ratio_mean", "mean importance ratio"),
    "grad_norm": ("grad_norm", "gradient norm (before clipping)"),
}
"""Chart file stem -> (metrics.jsonl key, title)."""

INDEX_CHUNK = 250
"""Steps per viewer index chunk (and per ``viewer/steps/<k>/`` folder)."""

MAX_CHART_POINTS = 2000
"""Points per plotted series; beyond, consecutive steps are averaged (:func:`downsample`)."""

_INDEX_METRICS = ("env_reward_mean", "loss", "ratio_mean", "grad_norm", "step_s")
"""The metrics a step's index summary carries (the step list's columns)."""

_EXT = {"image/png": "png", "image/jpeg": "jpg", "image/webp": "webp", "audio/wav": "wav", "video/mp4": "mp4"}

_NAN = float("nan")


def _number(value: Any) -> float:
    """``value`` as a float; NaN when it is missing or not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _NAN
    return float(value)


def _finite_or_none(value: Any) -> float | None:
    number = _number(value)
    return number if math.isfinite(number) else None


def _js_call(function: str, *args: bytes) -> bytes:
    """``function(arg, ...);`` with each JSON argument's ``</`` escaped (``<\\/`` is the same string
    to JSON): a ``</script>`` in a string cannot end the script should the file be inlined in a page."""
    return function.encode() + b"(" + b",".join(args).replace(b"</", b"<\\/") + b");\n"


def _js_json(path: Path, function: str) -> Any:
    """The last argument of a file :func:`_js_call` wrote; ``None`` if it is missing or not that."""
    try:
        text = path.read_bytes()
    except OSError:
        return None
    prefix, suffix = function.encode() + b"(", b");"
    text = text.strip()
    if not (text.startswith(prefix) and text.endswith(suffix)):
        return None
    body = text[len(prefix) : -len(suffix)]
    if function == "GB_INDEX":  # GB_INDEX(k,[...])
        body = body.partition(b",")[2]
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        logger.warning("%s: not a viewer file; ignored", path)
        return None


def downsample(
    x: np.ndarray, y: np.ndarray, max_points: int = MAX_CHART_POINTS
) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` points of ``(x, y)`` (``[N]`` each): ``N`` above it is cut into
    ``max_points`` runs of consecutive points, each drawn as its mean x and the mean of its finite
    y (a run of only NaN stays NaN: a gap in the line)."""
    import numpy as np

    n = len(x)
    if n <= max_points:
        return x, y
    starts = (np.arange(max_points, dtype=np.int64) * n) // max_points
    counts = np.diff(np.append(starts, n))
    xs = np.add.reduceat(np.asarray(x, dtype=np.float64), starts) / counts
    finite = np.isfinite(y)
    sums = np.add.reduceat(np.where(finite, y, 0.0), starts)
    kept = np.add.reduceat(finite.astype(np.int64), starts)
    ys = np.full(max_points, np.nan)
    np.divide(sums, kept, out=ys, where=kept > 0)
    return xs, ys


class ChartSeries:
    """What the charts plot, one value per step: :attr:`steps` and one ``array('d')`` per key, all
    the same length (NaN where a step's record lacks the key).

    Keys: each :data:`CHARTS` metric, ``step_s``, every ``timing/<phase>`` and
    ``payload/<boundary>`` (that boundary's ``serialized_bytes``). Steps only increase: appending
    step n first drops step n and later ones (a resumed run re-records the steps after its
    checkpoint).
    """

    def __init__(self) -> None:
        self.steps: array[float] = array("d")
        self.values: dict[str, array[float]] = {}

    def __len__(self) -> int:
        return len(self.steps)

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any]]) -> ChartSeries:
        series = cls()
        for record in records:
            series.append(record)
        return series

    @staticmethod
    def _plotted(record: Mapping[str, Any]) -> dict[str, float]:
        out = {key: _number(record.get(key)) for key in (*(k for k, _ in CHARTS.values()), "step_s")}
        for name, value in record.items():
            if name.startswith("timing/"):
                out[name] = _number(value)
        payload = record.get("payload")
        if isinstance(payload, Mapping):
            for boundary, stats in payload.items():
                size = stats.get("serialized_bytes") if isinstance(stats, Mapping) else None
                out[f"payload/{boundary}"] = _number(size)
        return out

    def append(self, record: Mapping[str, Any], *, step: int | None = None) -> None:
        """Add one ``metrics.jsonl`` record (its ``step``, or ``step``); a record without one is skipped."""
        number = _number(record.get("step") if step is None else step)
        if not math.isfinite(number):
            return
        self.truncate(number)
        n = len(self.steps)
        self.steps.append(number)
        for key, value in self._plotted(record).items():
            column = self.values.get(key)
            if column is None:
                column = self.values[key] = array("d", [_NAN]) * n
            column.append(value)
        for column in self.values.values():
            if len(column) == n:
                column.append(_NAN)

    def truncate(self, step: float) -> None:
        """Drop step ``step`` and the steps after it."""
        cut = bisect.bisect_left(self.steps, step)
        if cut < len(self.steps):
            del self.steps[cut:]
            for column in self.values.values():
                del column[cut:]

    def column(self, key: str) -> np.ndarray:
        """``key``'s values as ``[len(self)]`` float64 (all NaN for a key never recorded)."""
        import numpy as np

        found = self.values.get(key)
        if found is None:
            return np.full(len(self.steps), np.nan)
        return np.frombuffer(found, dtype=np.float64).copy()

    def prefixed(self, prefix: str) -> list[str]:
        """The keys that start with ``prefix`` (``payload/``, ``timing/``), sorted."""
        return sorted(k for k in self.values if k.startswith(prefix))


class RunArtifacts:
    """Writes the rollouts, media, charts and viewer of one run directory (module docstring)."""

    def __init__(
        self,
        path: Path,
        *,
        decode: Any = None,
        chart_every: int = 5,
        series: ChartSeries | None = None,
        index_chunk: int = INDEX_CHUNK,
    ) -> None:
        """``decode(token_ids) -> str`` renders generated text (``None``: token ids only); ``series``:
        the charts' values so far (a resumed run's: :meth:`ChartSeries.from_records` of its metrics.jsonl)."""
        self.path = Path(path)
        self.decode = decode
        self.chart_every = max(1, chart_every)
        self.series = series if series is not None else ChartSeries()
        self.index_chunk = max(1, index_chunk)
        self._charts_warned = False
        self._page_written = False
        self._chunk: int | None = None  # the index chunk held: the newest one
        self._entries: list[dict[str, Any]] = []  # its step summaries, in step order
        self._chunk_dirty = False
        for sub in ("rollouts", "media", "charts", "viewer"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        self._resume_index()

    @property
    def charts_path(self) -> Path:
        return self.path / "charts"

    @property
    def viewer_path(self) -> Path:
        return self.path / "viewer" / "index.html"

    @property
    def _index_path(self) -> Path:
        return self.path / "viewer" / "index"

    def _chunk_of(self, step: int) -> int:
        return max(step - 1, 0) // self.index_chunk

    def _chunk_path(self, k: int) -> Path:
        return self._index_path / f"chunk_{k}.js"

    def step_path(self, step: int) -> Path:
        """``viewer/steps/<k>/step_<n>.js``: step ``step``'s file for the viewer."""
        return self.path / "viewer" / "steps" / str(self._chunk_of(step)) / f"step_{step}.js"

    def _resume_index(self) -> None:
        """A resumed run goes on with the index it left: the manifest's chunk size and the newest
        chunk (earlier chunks and every step's files stay on disk as they are)."""
        manifest = _js_json(self.path / "viewer" / "data.js", "GB_MANIFEST")
        if isinstance(manifest, dict) and isinstance(manifest.get("chunk_size"), int):
            self.index_chunk = max(1, manifest["chunk_size"])
        if not self._index_path.is_dir():
            return
        chunks = [int(p.stem[6:]) for p in self._index_path.glob("chunk_*.js") if p.stem[6:].isdigit()]
        if chunks:
            self._chunk = max(chunks)
            self._entries = self._read_chunk(self._chunk)

    def _read_chunk(self, k: int) -> list[dict[str, Any]]:
        entries = _js_json(self._chunk_path(k), "GB_INDEX")
        if not isinstance(entries, list):
            return []
        return [e for e in entries if isinstance(e, dict) and isinstance(e.get("step"), int)]

    def _hold_chunk(self, step: int) -> None:
        """Hold the chunk of ``step`` with the summaries of the steps before it only."""
        k = self._chunk_of(step)
        if self._chunk != k:
            self._flush_chunk()
            self._chunk, self._entries = k, self._read_chunk(k)
        self._entries = [e for e in self._entries if e["step"] < step]
        self._chunk_dirty = True

    def _flush_chunk(self) -> None:
        if self._chunk is None or not self._chunk_dirty:
            return
        write_atomic(
            self._chunk_path(self._chunk),
            [_js_call("GB_INDEX", str(self._chunk).encode(), orjson.dumps(self._entries))],
        )
        self._chunk_dirty = False

    # ------------------------------------------------------------------ rollouts
    def _media_ref(self, item: MediaItem) -> dict[str, Any]:
        ext = _EXT.get(item.mime, "bin")
        rel = f"media/{item.key}.{ext}"
        if not (self.path / rel).exists():  # written whole (atomically) or not at all
            try:
                write_atomic(self.path / rel, [item.raw])
            except Exception as exc:  # a media item that cannot be read is shown as missing
                logger.warning("media %s not written: %s", item.key, exc)
                return {"key": item.key, "modality": item.modality, "path": None}
        return {"key": item.key, "modality": item.modality, "path": rel, "mime": item.mime}

    def _text(self, ids: Sequence[int]) -> str | None:
        if self.decode is None:
            return None
        try:
            return str(self.decode(list(ids)))
        except Exception:  # the viewer shows token ids when text cannot be decoded
            return None

    def _trajectory(self, traj: Trajectory, advantage: float | None) -> dict[str, Any]:
        return {
            "task_index": traj.task_index,
            "rollout_index": traj.rollout_index,
            "reward": float(traj.reward),
            "env_reward": float(traj.metadata.get("env_reward", traj.reward)),
            "advantage": advantage,
            "reward_components": dict(traj.reward_components),
            "mask_sample": traj.mask_sample,
            "truncated": traj.truncated,
            "failure_class": traj.failure_class,
            "failure_reason": traj.failure_reason,
            "turns": [
                {
                    "index": t.index,
                    "kind": t.kind,
                    "segment": t.segment,
                    "prompt_tokens": len(t.prompt_token_ids),
                    "generated_tokens": len(t.generation_token_ids),
                    "generation_token_ids": list(t.generation_token_ids),
                    "generation_logprobs": [round(float(x), 5) for x in t.generation_logprobs],
                    "text": self._text(t.generation_token_ids),
                    "tool_names": list(t.tool_names),
                    "policy_version": t.policy_version,
                    "media": [self._media_ref(m) for m in t.media],
                }
                for t in traj.turns
            ],
        }

    def rollout_records(self, groups: Iterable[GroupResult]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for g in groups:
            advantages: list[float | None] = [None] * len(g.trajectories)
            if g.batch is not None and len(g.batch) == len(g.trajectories):
                advantages = [float(a) for a in g.batch.advantages.tolist()]
            for traj, adv in zip(g.trajectories, advantages, strict=True):
                rec = self._trajectory(traj, adv)
                rec["group"] = g.task_index
                out.append(rec)
            for failure in g.failures:
                out.append({"group": g.task_index, "task_index": g.task_index, "failure": dict(failure)})
        return out

    def refresh_due(self, step: int) -> bool:
        """Whether step ``step`` redraws the charts and refreshes the viewer's index: step 1 and
        every ``chart_every``."""
        return step == 1 or step % self.chart_every == 0

    def record_step(
        self,
        step: int,
        groups: Iterable[GroupResult],
        record: Mapping[str, Any] | None = None,
        *,
        refresh: bool | None = None,
    ) -> None:
        """Write step ``step``'s rollouts (``record``: its ``metrics.jsonl`` line); with ``refresh``
        (default: :meth:`refresh_due`) redraw the charts and refresh the viewer."""
        self.write_step(step, self.rollout_records(groups), record or {}, refresh=refresh)

    def write_step(
        self,
        step: int,
        rows: Sequence[Mapping[str, Any]],
        record: Mapping[str, Any],
        *,
        refresh: bool | None = None,
    ) -> None:
        """:meth:`record_step` from rollout records already made (:meth:`rollout_records`)."""
        lines = [orjson.dumps(r, option=orjson.OPT_SERIALIZE_NUMPY) for r in rows]
        write_atomic(self.path / "rollouts" / f"step_{step}.jsonl", [line + b"\n" for line in lines])
        metrics = orjson.dumps(record, default=str, option=orjson.OPT_SERIALIZE_NUMPY)
        data = b'{"step":%d,"metrics":%s,"rollouts":[%s]}' % (step, metrics, b",".join(lines))
        write_atomic(self.step_path(step), [_js_call("GB_STEP", str(step).encode(), data)])
        self.series.append(record, step=step)
        self._hold_chunk(step)
        self._entries.append(self._summary(step, rows, record))
        if self.refresh_due(step) if refresh is None else refresh:
            self.refresh()

    @staticmethod
    def _summary(step: int, rows: Sequence[Mapping[str, Any]], record: Mapping[str, Any]) -> dict[str, Any]:
        """Step ``step``'s line in the viewer's step list."""
        ok = sum(1 for r in rows if "failure" not in r and not r.get("failure_class"))
        entry: dict[str, Any] = {"step": step, "ok": ok, "failed": len(rows) - ok}
        entry.update({key: _finite_or_none(record.get(key)) for key in _INDEX_METRICS})
        if record.get("skipped"):
            entry["skipped"] = str(record["skipped"])
        return entry

    def refresh(self) -> None:
        """Redraw the charts and refresh the viewer (both of constant size)."""
        self.draw_charts()
        self.write_viewer()

    def finish(self) -> None:
        self.refresh()

    # ------------------------------------------------------------------ charts
    def draw_charts(self, series: ChartSeries | None = None) -> list[Path]:
        """One PNG per :data:`CHARTS` entry plus ``payload.png`` and ``timing.png`` from ``series``
        (default: this run's; records: :meth:`ChartSeries.from_records`), each line at most
        :data:`MAX_CHART_POINTS` points; ``[]`` without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
            import numpy as np
        except ImportError:
            if not self._charts_warned:
                logger.warning("charts skipped: matplotlib is missing (pip install 'gymbridge[train]')")
                self._charts_warned = True
            return []
        series = self.series if series is None else series
        steps = np.frombuffer(series.steps, dtype=np.float64).copy()
        written: list[Path] = []
        for stem, (key, title) in CHARTS.items():
            xs, ys = downsample(steps, series.column(key))
            fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
            ax.plot(xs, ys, marker="." if len(xs) < 60 else None, color="#1f77b4")
            if stem == "env_reward":
                ax.set_ylim(-0.05, 1.05)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            fig.tight_layout()
            written.append(self._save(fig, stem))
            plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
        boundaries = series.prefixed("payload/")
        for key in boundaries:
            xs, ys = downsample(steps, np.nan_to_num(series.column(key), nan=0.0))
            ax.plot(xs, ys, label=key.removeprefix("payload/"))
        ax.set_title("payload bytes per step and boundary (pickle-5)")
        ax.set_xlabel("step")
        ax.set_yscale("symlog")
        if boundaries:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(self._save(fig, "payload"))
        plt.close(fig)
        written.append(self._timing_chart(plt, series, steps))
        return written

    def _timing_chart(self, plt: Any, series: ChartSeries, steps: np.ndarray) -> Path:
        """``timing.png``: each step's phases stacked (``timing/*``, :mod:`gymbridge.run.timing`)."""
        import numpy as np

        from gymbridge.run.timing import PHASES

        timed = np.isfinite(series.column("timing/other"))
        layers = {p: np.nan_to_num(series.column(f"timing/{p}")[timed], nan=0.0) for p in PHASES}
        shown = [p for p in PHASES if np.any(layers[p] != 0.0)]
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
        if timed.any() and shown:
            x = steps[timed]
            # ``other`` can be slightly negative (rounding): stacked at 0, it is in the legend's total
            stacked = [downsample(x, np.maximum(layers[p], 0.0))[1] for p in shown]
            xs, step_s = downsample(x, series.column("step_s")[timed])
            colors = plt.get_cmap("tab20").colors
            ax.stackplot(xs, stacked, labels=shown, colors=colors[: len(shown)], step="mid")
            ax.plot(xs, step_s, color="black", lw=1, drawstyle="steps-mid", label="step_s")
            ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
        ax.set_title("step time by phase (s)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = self._save(fig, "timing")
        plt.close(fig)
        return path

    def _save(self, fig: Any, stem: str) -> Path:
        import io

        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        path = self.charts_path / f"{stem}.png"
        write_atomic(path, [buf.getvalue()])
        return path

    # ------------------------------------------------------------------ viewer
    def write_viewer(self) -> Path:
        """The newest index chunk, the manifest ``viewer/data.js`` and ``viewer/index.html``."""
        self._flush_chunk()
        chunk = self._chunk
        manifest = {
            "title": self.path.name,
            "chunk_size": self.index_chunk,
            "chunks": 0 if chunk is None else chunk + 1,
            "last_step": self._entries[-1]["step"] if self._entries else (chunk or 0) * self.index_chunk,
        }
        write_atomic(self.path / "viewer" / "data.js", [_js_call("GB_MANIFEST", orjson.dumps(manifest))])
        if not self._page_written:
            template = resources.files("gymbridge.run").joinpath("viewer.html").read_text(encoding="utf-8")
            page = template.replace("{{TITLE}}", html.escape(self.path.name))
            write_atomic(self.viewer_path, [page.encode()])
            self._page_written = True
        return self.viewer_path
