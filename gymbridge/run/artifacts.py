"""What a user looks at in a run directory: per-step rollouts, their media, charts and a static viewer.

Layout (next to :mod:`gymbridge.run.rundir`'s files)::

    DIR/rollouts/step_<n>.jsonl   one JSON object per rollout of step n (every group, failed ones too)
    DIR/media/<key>.<ext>         each media item once, named by its content key
    DIR/charts/*.png              env reward, loss, ratio, grad norm per step; payload bytes per boundary;
                                  timing.png: each step's seconds split by phase (``timing/*``)
    DIR/viewer/index.html         a static page (open it from disk) over viewer/data.js

A rollout record holds ``task_index``, ``rollout_index``, ``reward``, ``advantage`` (``None``
when the group was not trained), ``reward_components``, failure fields and its ``turns``:
each turn's kind, prompt / generated token counts, the generated token ids and text, its
policy version and its media as ``{"key", "modality", "path"}`` (``path`` relative to DIR).
A group that failed adds one record per failure (``failure: {...}``, no turns).

Invariants: media are written once per content key (the same image in many rollouts or
steps is one file); every file is written atomically, so a viewer or chart read mid-run
sees a whole file; charts are drawn with matplotlib's non-interactive Agg backend (the
``train`` extra; without matplotlib the charts are skipped with one warning, everything
else is still written); nothing here changes training.
"""

from __future__ import annotations

import html
import logging
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from gymbridge.safe_io import write_atomic

if TYPE_CHECKING:
    from gymbridge.bridge import GroupResult
    from gymbridge.media import MediaItem
    from gymbridge.trajectory import Trajectory

logger = logging.getLogger(__name__)

__all__ = ["CHARTS", "RunArtifacts"]

CHARTS: dict[str, tuple[str, str]] = {
    "env_reward": ("env_reward_mean", "mean environment reward"),
    "loss": ("loss", "GRPO loss"),
    "ratio": ("ratio_mean", "mean importance ratio"),
    "grad_norm": ("grad_norm", "gradient norm (before clipping)"),
}
"""Chart file stem -> (metrics.jsonl key, title)."""

_EXT = {"image/png": "png", "image/jpeg": "jpg", "image/webp": "webp", "audio/wav": "wav", "video/mp4": "mp4"}


class RunArtifacts:
    """Writes the rollouts, media, charts and viewer of one run directory."""

    def __init__(self, path: Path, *, decode: Any = None, chart_every: int = 5) -> None:
        """``decode(token_ids) -> str`` renders generated text (``None``: token ids only)."""
        self.path = Path(path)
        self.decode = decode
        self.chart_every = max(1, chart_every)
        self._media_written: set[str] = set()
        self._steps: list[dict[str, Any]] = []
        self._charts_warned = False
        for sub in ("rollouts", "media", "charts", "viewer"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        self._load_existing()

    @property
    def charts_path(self) -> Path:
        return self.path / "charts"

    @property
    def viewer_path(self) -> Path:
        return self.path / "viewer" / "index.html"

    def _load_existing(self) -> None:
        """A resumed run keeps showing the steps written before it (and their media)."""
        self._media_written.update(p.stem for p in (self.path / "media").iterdir() if p.is_file())
        for f in sorted((self.path / "rollouts").glob("step_*.jsonl"), key=lambda p: int(p.stem[5:])):
            rows = [orjson.loads(line) for line in f.read_bytes().splitlines() if line.strip()]
            self._steps.append({"step": int(f.stem[5:]), "rollouts": rows})

    # ------------------------------------------------------------------ rollouts
    def _media_ref(self, item: MediaItem) -> dict[str, Any]:
        ext = _EXT.get(item.mime, "bin")
        rel = f"media/{item.key}.{ext}"
        if item.key not in self._media_written:
            try:
                write_atomic(self.path / rel, [item.raw])
                self._media_written.add(item.key)
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
        """Whether step ``step`` redraws the charts and the viewer: step 1 and every ``chart_every``
        (their cost grows with the run: every step's would be quadratic)."""
        return step == 1 or step % self.chart_every == 0

    def record_step(
        self,
        step: int,
        groups: Iterable[GroupResult],
        records: Sequence[Mapping[str, Any]],
        *,
        refresh: bool | None = None,
    ) -> None:
        """Write step ``step``'s rollouts; with ``refresh`` (default: :meth:`refresh_due`) redraw the
        charts and refresh the viewer."""
        rows = self.rollout_records(groups)
        write_atomic(
            self.path / "rollouts" / f"step_{step}.jsonl",
            [orjson.dumps(r, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n" for r in rows],
        )
        self._steps = [s for s in self._steps if s["step"] != step] + [{"step": step, "rollouts": rows}]
        if self.refresh_due(step) if refresh is None else refresh:
            self.draw_charts(records)
            self.write_viewer(records)

    def finish(self, records: Sequence[Mapping[str, Any]]) -> None:
        self.draw_charts(records)
        self.write_viewer(records)

    # ------------------------------------------------------------------ charts
    def draw_charts(self, records: Sequence[Mapping[str, Any]]) -> list[Path]:
        """One PNG per :data:`CHARTS` entry plus ``payload.png`` and ``timing.png``; ``[]`` without
        matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            if not self._charts_warned:
                logger.warning("charts skipped: matplotlib is missing (pip install 'gymbridge[train]')")
                self._charts_warned = True
            return []
        steps = [int(r["step"]) for r in records]
        written: list[Path] = []
        for stem, (key, title) in CHARTS.items():
            values = [float(r[key]) if r.get(key) is not None else float("nan") for r in records]
            fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
            ax.plot(steps, values, marker="." if len(steps) < 60 else None, color="#1f77b4")
            if stem == "env_reward":
                ax.set_ylim(-0.05, 1.05)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            fig.tight_layout()
            written.append(self._save(fig, stem))
            plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
        boundaries = sorted({b for r in records for b in (r.get("payload") or {})})
        for b in boundaries:
            ys = [float((r.get("payload") or {}).get(b, {}).get("serialized_bytes", 0)) for r in records]
            ax.plot(steps, ys, label=b)
        ax.set_title("payload bytes per step and boundary (pickle-5)")
        ax.set_xlabel("step")
        ax.set_yscale("symlog")
        if boundaries:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(self._save(fig, "payload"))
        plt.close(fig)
        written.append(self._timing_chart(plt, records))
        return written

    def _timing_chart(self, plt: Any, records: Sequence[Mapping[str, Any]]) -> Path:
        """``timing.png``: each step's phases stacked (``timing/*``, :mod:`gymbridge.run.timing`)."""
        from gymbridge.run.timing import PHASES

        timed = [r for r in records if "timing/other" in r]
        steps = [int(r["step"]) for r in timed]
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
        shown = [p for p in PHASES if any(float(r.get(f"timing/{p}", 0.0)) for r in timed)]
        if steps and shown:
            # ``other`` can be slightly negative (rounding): stacked at 0, it is in the legend's total
            layers = [[max(0.0, float(r.get(f"timing/{p}", 0.0))) for r in timed] for p in shown]
            colors = plt.get_cmap("tab20").colors
            ax.stackplot(steps, layers, labels=shown, colors=colors[: len(shown)], step="mid")
            step_s = [float(r["step_s"]) for r in timed]
            ax.plot(steps, step_s, color="black", lw=1, drawstyle="steps-mid", label="step_s")
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
    def write_viewer(self, records: Sequence[Mapping[str, Any]]) -> Path:
        """``viewer/index.html`` + ``viewer/data.js`` (data as a script: works from ``file://``)."""
        data = {"steps": sorted(self._steps, key=lambda s: s["step"]), "metrics": list(records)}
        payload = orjson.dumps(data, default=str, option=orjson.OPT_SERIALIZE_NUMPY).decode()
        payload = payload.replace("</", "<\\/")  # a "</script>" inside a string cannot end the script
        write_atomic(self.path / "viewer" / "data.js", [b"window.RUN = ", payload.encode(), b";\n"])
        template = resources.files("gymbridge.run").joinpath("viewer.html").read_text(encoding="utf-8")
        page = template.replace("{{TITLE}}", html.escape(self.path.name))
        write_atomic(self.viewer_path, [page.encode()])
        return self.viewer_path
