"""What a user looks at in a run directory: per-step rollouts, their media, charts and a static viewer.

Layout (next to :mod:`gymbridge.run.rundir`'s files; ``C`` is the index chunk size, :data:`INDEX_CHUNK`,
and step n's chunk is ``k = (n - 1) // C``)::

    DIR/rollouts/step_<n>.jsonl       one JSON object per rollout of step n (every group, failed ones too)
    DIR/media/<key>.<ext>             each media item once, named by its content key
    DIR/charts/*.png                  env reward, loss, ratio, grad norm per step; payload bytes per boundary;
                                      timing.png: each step's seconds split by phase (``timing/*``);
                                      with validation, env_reward.png adds each pass's reward mean and
                                      eval.png draws its pass@1[avg-of-k], pass@k, majority@k (a panel
                                      per environment when there are several) on the same step axis
    DIR/viewer/index.html             a static page: open it from disk (it loads scripts, never fetches)
    DIR/viewer/data.js                the manifest: GB_MANIFEST({title, chunk_size, chunks, last_step})
    DIR/viewer/index/chunk_<k>.js     GB_INDEX(k, [...]): a summary of each step of chunk k (step, headline
                                      metrics, ok / failed rollouts)
    DIR/viewer/steps/<k>/step_<n>.js  GB_STEP(n, {step, metrics, rollouts}): step n's rollout records (those
                                      of rollouts/step_<n>.jsonl) and its metrics.jsonl record
    DIR/viewer/eval/index/chunk_<k>.js  GB_EVAL_INDEX(k, [...]): a summary of each validation pass after a
                                      step of chunk k (step 0: chunk 0): reward mean, the headline pass@k
                                      keys, ok / failed rollouts, the same per environment
    DIR/viewer/eval/<k>/step_<n>.js   GB_EVAL(n, {step, record, rollouts}): the pass after step n (its
                                      eval.jsonl line and the lines of eval/step_<n>.jsonl)

The page lists the steps (a page of them at a time) and draws the env reward curve from the index
chunks, and loads a step's file only when it is opened (``index.html#step-<n>``; the last step by
default); its Validation panel lists the passes from their index chunks, marks their reward mean on
the curve and loads a pass's file only when it is opened (``index.html#eval-<n>``). A rollout
record holds ``task_index``, ``rollout_index``, ``reward``, ``advantage`` (``None`` when the group
was not trained), ``reward_components``, failure fields and its ``turns``: each turn's kind,
prompt / generated token counts, the generated token ids and text, its policy version and its
media as ``{"key", "modality", "path"}`` (``path`` relative to DIR).
A group that failed adds one record per failure (``failure: {...}``, no turns).

Invariants:

* no file grows with the run's length; earlier steps are never rewritten. A step writes its
  rollouts file and its step file once; a refresh (step 1, every ``chart_every`` steps, the end)
  rewrites the newest index chunk (at most C summaries), the manifest and the charts, whose
  series are averaged down to at most :data:`MAX_CHART_POINTS` points. A validation pass writes
  its file once and rewrites the newest validation index chunk and the manifest (and, unless
  told not to, the two charts that show validation); recording step n drops the passes at step n
  and later (a resumed run's, after its checkpoint: a pass follows the step it validates);
* memory does not hold earlier steps: :class:`RunArtifacts` keeps one index chunk of each kind and
  the chart series (:class:`ChartSeries`, :class:`EvalSeries`: 8 bytes per step or pass and plotted
  key); a resumed run reads back only the manifest and the newest index chunks (re-recording step n
  drops the summaries of n and later);
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
import re
from array import array
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import orjson

from gymbridge.metrics.passk import headline
from gymbridge.safe_io import write_atomic

if TYPE_CHECKING:
    import numpy as np

    from gymbridge.bridge import GroupResult
    from gymbridge.media import MediaItem
    from gymbridge.trajectory import Trajectory

logger = logging.getLogger(__name__)

__all__ = [
    "CHARTS",
    "EVAL_CHART_KEYS",
    "INDEX_CHUNK",
    "MAX_CHART_POINTS",
    "MAX_EVAL_ENVS",
    "ChartSeries",
    "EvalSeries",
    "RunArtifacts",
    "downsample",
]

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

MAX_EVAL_ENVS = 8
"""Environments drawn in their own validation panel (``eval.png``) and reward line; beyond, the first
in name order (every environment is still listed in the viewer)."""

EVAL_CHART_KEYS = ("pass@1[avg-of-k]", "pass@k", "majority@k")
"""The headline aggregates ``eval.png`` draws (of the first score, ``accuracy`` by default)."""

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
    if function in ("GB_INDEX", "GB_EVAL_INDEX"):  # GB_INDEX(k,[...])
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


def _step_range(*steps: np.ndarray) -> tuple[float, float]:
    """The x limits that hold every step of ``steps`` (each in step order), at least 1 wide."""
    ends = [float(x) for s in steps if len(s) for x in (s[0], s[-1])]
    lo, hi = (min(ends), max(ends)) if ends else (0.0, 1.0)
    pad = max(hi - lo, 1.0) * 0.03
    return lo - pad, hi + pad


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
    def from_records(cls, records: Iterable[Mapping[str, Any]]) -> Self:
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


_AGGREGATES = (
    (re.compile(r"pass@1\[avg-of-\d+\]"), "pass@1[avg-of-k]"),
    (re.compile(r"pass@\d+"), "pass@k"),
    (re.compile(r"majority@\d+"), "majority@k"),
)


def _generic(aggregate: str) -> str | None:
    """``pass@1[avg-of-4]`` -> ``pass@1[avg-of-k]``, ``pass@4`` -> ``pass@k``, ``majority@4`` ->
    ``majority@k`` (:data:`EVAL_CHART_KEYS`); ``None`` for anything else."""
    for pattern, name in _AGGREGATES:
        if pattern.fullmatch(aggregate):
            return name
    return None


def _headline(metrics: Any) -> dict[str, float | None]:
    """The pass@k keys a pass's summary carries (:func:`gymbridge.metrics.passk.headline`)."""
    if not isinstance(metrics, Mapping):
        return {}
    numbers = {k: v for k, v in metrics.items() if isinstance(k, str) and math.isfinite(_number(v))}
    return {key: _finite_or_none(value) for key, value in headline(numbers).items()}


def _chart_score(picked: Mapping[str, Any]) -> str | None:
    """The score the validation chart draws: ``accuracy`` if there, else the first headline one."""
    names = [key.partition("/")[2] for key in picked]
    return "accuracy" if "accuracy" in names else next(iter(names), None)


class EvalSeries(ChartSeries):
    """What the validation charts plot, one value per pass (``eval.jsonl`` records, by their
    ``step``): ``reward_mean`` and :data:`EVAL_CHART_KEYS` (of the pass's chart score: ``accuracy``
    by default), and the same per environment as ``env/<name>/<key>``.

    As :class:`ChartSeries`: steps only increase, re-recording step n drops n and later.
    :attr:`labels` names each aggregate as the last record did (``pass@k`` -> ``pass@4/accuracy``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.labels: dict[str, str] = {}

    @staticmethod
    def _picked(record: Mapping[str, Any]) -> dict[str, tuple[str, float]]:
        """Generic aggregate -> (its key in the record, its value), of the chart score."""
        picked = _headline(record.get("metrics"))
        score = _chart_score(picked)
        out: dict[str, tuple[str, float]] = {}
        for key, value in picked.items():
            aggregate, _, name = key.partition("/")
            generic = _generic(aggregate)
            if name == score and generic is not None:
                out[generic] = (key, _NAN if value is None else value)
        return out

    @staticmethod
    def _values(record: Mapping[str, Any]) -> dict[str, float]:
        out = {"reward_mean": _number(record.get("reward_mean"))}
        out.update({generic: value for generic, (_, value) in EvalSeries._picked(record).items()})
        return out

    @staticmethod
    def _plotted(record: Mapping[str, Any]) -> dict[str, float]:
        out = EvalSeries._values(record)
        envs = record.get("env")
        if isinstance(envs, Mapping):
            for name, env in envs.items():
                if isinstance(env, Mapping):
                    out.update({f"env/{name}/{k}": v for k, v in EvalSeries._values(env).items()})
        return out

    def append(self, record: Mapping[str, Any], *, step: int | None = None) -> None:
        """Add one ``eval.jsonl`` record (its ``step``, or ``step``); one without is skipped."""
        super().append(record, step=step)
        self.labels.update({generic: key for generic, (key, _) in self._picked(record).items()})

    def envs(self) -> list[str]:
        """The environments recorded (``env/<name>/...`` keys), in name order."""
        return sorted({key[4:].rpartition("/")[0] for key in self.prefixed("env/")})


class _Index:
    """The newest chunk of one of the viewer's indexes (the steps' ``GB_INDEX``, the validation
    passes' ``GB_EVAL_INDEX``): chunk :attr:`k`'s summaries in step order, the earlier chunks on disk.
    Step n's chunk is ``(n - 1) // chunk_size`` (step 0's: 0)."""

    def __init__(self, folder: Path, function: str, chunk_size: int) -> None:
        self.folder = folder
        self.function = function
        self.chunk_size = chunk_size
        self.k: int | None = None
        self.entries: list[dict[str, Any]] = []
        self.dirty = False

    def chunk_of(self, step: int) -> int:
        return max(step - 1, 0) // self.chunk_size

    def path(self, k: int) -> Path:
        return self.folder / f"chunk_{k}.js"

    @property
    def chunks(self) -> int:
        """How many chunks the manifest names: the held one and those before it."""
        return 0 if self.k is None else self.k + 1

    @property
    def last_step(self) -> int:
        return self.entries[-1]["step"] if self.entries else (self.k or 0) * self.chunk_size

    def resume(self) -> None:
        """Hold the newest chunk on disk (a resumed run goes on with it)."""
        if not self.folder.is_dir():
            return
        chunks = [int(p.stem[6:]) for p in self.folder.glob("chunk_*.js") if p.stem[6:].isdigit()]
        if chunks:
            self.k = max(chunks)
            self.entries = self.read(self.k)

    def read(self, k: int) -> list[dict[str, Any]]:
        entries = _js_json(self.path(k), self.function)
        if not isinstance(entries, list):
            return []
        return [e for e in entries if isinstance(e, dict) and isinstance(e.get("step"), int)]

    def hold(self, step: int) -> None:
        """Hold the chunk of ``step`` with the summaries of the steps before it only."""
        k = self.chunk_of(step)
        if self.k != k:
            self.flush()
            self.k, self.entries = k, self.read(k)
        self.entries = [e for e in self.entries if e["step"] < step]
        self.dirty = True

    def add(self, entry: dict[str, Any]) -> None:
        """``entry`` (a summary of step ``entry["step"]``) in place of that step's and later ones."""
        self.hold(entry["step"])
        self.entries.append(entry)

    def drop_from(self, step: int) -> None:
        """Forget the summaries of ``step`` and later, if any is held (nothing is read otherwise)."""
        if self.k is not None and (
            self.k > self.chunk_of(step) or (self.entries and self.entries[-1]["step"] >= step)
        ):
            self.hold(step)

    def flush(self) -> None:
        if self.k is None or not self.dirty:
            return
        write_atomic(
            self.path(self.k), [_js_call(self.function, str(self.k).encode(), orjson.dumps(self.entries))]
        )
        self.dirty = False


class RunArtifacts:
    """Writes the rollouts, media, charts and viewer of one run directory (module docstring)."""

    def __init__(
        self,
        path: Path,
        *,
        decode: Any = None,
        chart_every: int = 5,
        series: ChartSeries | None = None,
        eval_series: EvalSeries | None = None,
        index_chunk: int = INDEX_CHUNK,
    ) -> None:
        """``decode(token_ids) -> str`` renders generated text (``None``: token ids only); ``series``,
        ``eval_series``: the charts' values so far (a resumed run's: ``from_records`` of its
        ``metrics.jsonl`` and ``eval.jsonl``)."""
        self.path = Path(path)
        self.decode = decode
        self.chart_every = max(1, chart_every)
        self.series = series if series is not None else ChartSeries()
        self.eval_series = eval_series if eval_series is not None else EvalSeries()
        self.index_chunk = max(1, index_chunk)
        self._charts_warned = False
        self._page_written = False
        for sub in ("rollouts", "media", "charts", "viewer"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        self._resume_index()

    @property
    def charts_path(self) -> Path:
        return self.path / "charts"

    @property
    def viewer_path(self) -> Path:
        return self.path / "viewer" / "index.html"

    def _chunk_of(self, step: int) -> int:
        return max(step - 1, 0) // self.index_chunk

    def step_path(self, step: int) -> Path:
        """``viewer/steps/<k>/step_<n>.js``: step ``step``'s file for the viewer."""
        return self.path / "viewer" / "steps" / str(self._chunk_of(step)) / f"step_{step}.js"

    def eval_step_path(self, step: int) -> Path:
        """``viewer/eval/<k>/step_<n>.js``: the viewer's file of the validation pass after step ``step``."""
        return self.path / "viewer" / "eval" / str(self._chunk_of(step)) / f"step_{step}.js"

    def _resume_index(self) -> None:
        """A resumed run goes on with the indexes it left: the manifest's chunk size and the newest
        chunk of each (earlier chunks and every step's and pass's files stay on disk as they are)."""
        manifest = _js_json(self.path / "viewer" / "data.js", "GB_MANIFEST")
        if isinstance(manifest, dict) and isinstance(manifest.get("chunk_size"), int):
            self.index_chunk = max(1, manifest["chunk_size"])
        self._steps = _Index(self.path / "viewer" / "index", "GB_INDEX", self.index_chunk)
        self._evals = _Index(self.path / "viewer" / "eval" / "index", "GB_EVAL_INDEX", self.index_chunk)
        self._steps.resume()
        self._evals.resume()

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
        self._steps.add(self._summary(step, rows, record))
        # a pass follows the step it validates: one at this step or later is a rewound attempt's
        self.eval_series.truncate(step)
        self._evals.drop_from(step)
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

    def record_eval(
        self, record: Mapping[str, Any], rollouts: Sequence[Mapping[str, Any]], *, refresh: bool = True
    ) -> None:
        """Write the viewer's file of a validation pass (``record``: its ``eval.jsonl`` line,
        ``rollouts``: the lines of its ``eval/step_<n>.jsonl``), its summary in the validation index
        and the manifest; with ``refresh``, redraw the charts that show validation."""
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            logger.warning("a validation record without a step: not shown (%s)", sorted(record))
            return
        data = orjson.dumps(
            {"step": step, "record": record, "rollouts": list(rollouts)},
            default=str,
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        write_atomic(self.eval_step_path(step), [_js_call("GB_EVAL", str(step).encode(), data)])
        self.eval_series.append(record, step=step)
        self._evals.add(self._eval_summary(step, record))
        if refresh:
            self.draw_eval_charts()
        self.write_viewer()

    @staticmethod
    def _eval_summary(step: int, record: Mapping[str, Any]) -> dict[str, Any]:
        """The pass's line in the viewer's Validation list (and one per environment)."""

        def counts(rec: Mapping[str, Any]) -> dict[str, Any]:
            return {
                "prompts": rec.get("prompts"),
                "ok": rec.get("rollouts_ok"),
                "failed": rec.get("rollouts_failed"),
                "reward_mean": _finite_or_none(rec.get("reward_mean")),
                "metrics": _headline(rec.get("metrics")),
            }

        entry: dict[str, Any] = {
            "step": step,
            "policy_version": record.get("policy_version"),
            "when": record.get("when"),
            "n": record.get("n"),
            "elapsed_s": _finite_or_none(record.get("elapsed_s")),
            **counts(record),
        }
        envs = record.get("env")
        if isinstance(envs, Mapping):
            entry["env"] = {str(name): counts(env) for name, env in envs.items() if isinstance(env, Mapping)}
        return entry

    def refresh(self) -> None:
        """Redraw the charts and refresh the viewer (both of constant size)."""
        self.draw_charts()
        self.write_viewer()

    def finish(self) -> None:
        self.refresh()

    # ------------------------------------------------------------------ charts
    def _pyplot(self) -> Any:
        """``matplotlib.pyplot`` on the Agg backend; ``None`` (warned once) without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            if not self._charts_warned:
                logger.warning("charts skipped: matplotlib is missing (pip install 'gymbridge[train]')")
                self._charts_warned = True
            return None
        return plt

    def draw_charts(
        self, series: ChartSeries | None = None, eval_series: EvalSeries | None = None
    ) -> list[Path]:
        """One PNG per :data:`CHARTS` entry plus ``payload.png`` and ``timing.png`` from ``series``
        (default: this run's; records: :meth:`ChartSeries.from_records`), and with validation passes
        in ``eval_series`` (default: this run's) ``eval.png``; each line at most
        :data:`MAX_CHART_POINTS` points; ``[]`` without matplotlib."""
        plt = self._pyplot()
        if plt is None:
            return []
        import numpy as np

        series = self.series if series is None else series
        eval_series = self.eval_series if eval_series is None else eval_series
        steps = np.frombuffer(series.steps, dtype=np.float64).copy()
        written: list[Path] = []
        for stem, (key, title) in CHARTS.items():
            written.append(self._metric_chart(plt, stem, key, title, series, steps, eval_series))
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
        if len(eval_series):
            written.append(self._eval_chart(plt, eval_series, steps))
        return written

    def draw_eval_charts(self) -> list[Path]:
        """The charts that show validation: ``env_reward.png`` and ``eval.png`` (after a pass)."""
        plt = self._pyplot()
        if plt is None or not len(self.eval_series):
            return []
        import numpy as np

        steps = np.frombuffer(self.series.steps, dtype=np.float64).copy()
        key, title = CHARTS["env_reward"]
        return [
            self._metric_chart(plt, "env_reward", key, title, self.series, steps, self.eval_series),
            self._eval_chart(plt, self.eval_series, steps),
        ]

    def _metric_chart(
        self,
        plt: Any,
        stem: str,
        key: str,
        title: str,
        series: ChartSeries,
        steps: np.ndarray,
        eval_series: EvalSeries,
    ) -> Path:
        """One :data:`CHARTS` entry; ``env_reward`` adds each validation pass's reward mean (and
        each environment's, when there are several)."""
        import numpy as np

        validation = stem == "env_reward" and len(eval_series) > 0
        xs, ys = downsample(steps, series.column(key))
        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
        ax.plot(xs, ys, marker="." if len(xs) < 60 else None, color="#1f77b4", label="training")
        if stem == "env_reward":
            ax.set_ylim(-0.05, 1.05)
        if validation:
            eval_steps = np.frombuffer(eval_series.steps, dtype=np.float64).copy()
            colors = plt.get_cmap("tab10").colors
            envs = eval_series.envs()
            lines = [("validation", "reward_mean")]
            if len(envs) > 1:
                lines += [(f"validation {env}", f"env/{env}/reward_mean") for env in envs[:MAX_EVAL_ENVS]]
            for i, (label, column) in enumerate(lines):
                exs, eys = downsample(eval_steps, eval_series.column(column))
                ax.plot(
                    exs,
                    eys,
                    marker="o" if len(exs) < 60 else None,
                    markersize=4 if i == 0 else 2,
                    lw=1.5 if i == 0 else 0.8,
                    ls="-" if i == 0 else "--",
                    color=colors[(i + 1) % len(colors)],
                    label=label,
                )
            ax.set_xlim(*_step_range(steps, eval_steps))
            ax.legend(fontsize=6)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = self._save(fig, stem)
        plt.close(fig)
        return path

    def _eval_chart(self, plt: Any, eval_series: EvalSeries, steps: np.ndarray) -> Path:
        """``eval.png``: each pass's :data:`EVAL_CHART_KEYS` (%) over steps, on ``env_reward.png``'s
        step axis; one panel for all environments, then one per environment when there are several
        (a grid of up to three columns)."""
        import numpy as np

        envs = eval_series.envs()
        panels = [("validation", "")]
        if len(envs) > 1:
            shown = envs[:MAX_EVAL_ENVS]
            more = f" ({len(shown)} of {len(envs)} environments below)" if len(envs) > len(shown) else ""
            panels = [("validation, all environments" + more, "")]
            panels += [(f"validation, {env}", f"env/{env}/") for env in shown]
        elif envs:
            panels = [(f"validation, {envs[0]}", "")]
        eval_steps = np.frombuffer(eval_series.steps, dtype=np.float64).copy()
        columns = min(len(panels), 3)  # a grid, so that many environments do not make one tall strip
        rows = -(-len(panels) // columns)
        fig, axes = plt.subplots(
            rows,
            columns,
            figsize=(6 if columns == 1 else 4.2 * columns, 3.2 * rows),
            dpi=100,
            sharex=True,
            squeeze=False,
        )
        for ax in axes.flat[len(panels) :]:
            ax.axis("off")
        colors = plt.get_cmap("tab10").colors
        for ax, (title, prefix) in zip(axes.flat, panels, strict=False):
            for i, generic in enumerate(EVAL_CHART_KEYS):
                column = eval_series.column(prefix + generic)
                if not np.isfinite(column).any():
                    continue
                xs, ys = downsample(eval_steps, column)
                ax.plot(
                    xs,
                    ys,
                    marker="o" if len(xs) < 60 else None,
                    markersize=3,
                    color=colors[(i + 2) % len(colors)],
                    label=eval_series.labels.get(generic, generic),
                )
            ax.set_ylim(-3, 103)
            ax.set_ylabel("%")
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=6)
            ax.set_xlabel("step")
        axes[0, 0].set_xlim(*_step_range(steps, eval_steps))  # shared: env_reward.png's step axis
        fig.tight_layout()
        path = self._save(fig, "eval")
        plt.close(fig)
        return path

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
        """The newest index chunks, the manifest ``viewer/data.js`` and ``viewer/index.html``."""
        self._steps.flush()
        self._evals.flush()
        manifest = {
            "title": self.path.name,
            "chunk_size": self.index_chunk,
            "chunks": self._steps.chunks,
            "last_step": self._steps.last_step,
            "eval_chunks": self._evals.chunks,
            "eval_last_step": self._evals.last_step,
        }
        write_atomic(self.path / "viewer" / "data.js", [_js_call("GB_MANIFEST", orjson.dumps(manifest))])
        if not self._page_written:
            template = resources.files("gymbridge.run").joinpath("viewer.html").read_text(encoding="utf-8")
            page = template.replace("{{TITLE}}", html.escape(self.path.name))
            write_atomic(self.viewer_path, [page.encode()])
            self._page_written = True
        return self.viewer_path
