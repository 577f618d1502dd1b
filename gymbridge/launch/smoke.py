"""``gymbridge smoke``: the whole data flow on loopback, in one command, in well under a minute.

On local defaults (``gymbridge/configs/smoke.yaml``) it

1. generates a small dataset with the environment's data generator (``color_pick``: name the
   colour of the image) and writes it as jsonl (the bridge reads it like any dataset);
2. starts, in this process on 127.0.0.1 free ports: the environment server, a model server
   (:class:`~gymbridge.generation.ModelServer`) over the tiny offline Qwen2-VL, and
   gymbridge's :class:`~gymbridge.server.SimpleAgent` between them (the Gym path); or, with
   ``--native``, only the environment, driven by :func:`~gymbridge.rollout.run_episode`.
   With ``generator.placement: process`` the model server is ``gymbridge model serve`` in a
   child process instead (:mod:`gymbridge.launch.placement`);
3. runs ``steps`` GRPO steps: the :class:`~gymbridge.bridge.BridgeIterator` collects
   ``prompts_per_step`` x ``group_size`` rollouts, then the
   :class:`~gymbridge.trainer.GRPOTrainer` (or, with ``dp_workers > 0``, the
   :class:`~gymbridge.trainer.RayDPTrainer`'s Ray actors in one torch.distributed group, whose
   rank 0 hands back the new weights) updates the policy and publishes it to the generator, which holds a
   model of its own, as the next policy version (a copy in process, a torch.distributed
   broadcast to a child process); the drift guard fails the run if the next step's ratio
   says the generator did not get it;
4. prints one line per step (environment reward and shaped reward separately, loss, tokens,
   grad norm, rollouts ok / failed, time), a summary of how the shaped reward moved from the
   first to the last step, and the payload table; and stops every server it started, on
   success, error or Ctrl-C.

**Learning from the environment's reward alone.** The default run trains on ``color_pick``
with no shaping: a short supervised format warm-up (:mod:`gymbridge.launch.warmup`, on
image-independent targets) teaches the tiny model the answer format, never the answer; GRPO
then learns from the env reward which colour the image shows. The toy dense shaping of
:class:`~gymbridge.bridge.TokenRateShaping` stays available (``--set shaping.kind=token_rate``)
for environments the random tiny model never solves.

**Reproducibility.** With ``reproducible: true`` (default) sampling is seeded from ``seed``:
native rollouts per ``(seed, task, rollout index)`` (:func:`~gymbridge.bridge.rollout_seed`), the
Gym path (where the rollout index never reaches the model server) per ``(seed, prompt tokens,
occurrence)`` (:class:`~gymbridge.bridge.PromptSeededGenerator`); a rerun with the same
``--seed`` prints the same numbers on the native path, and the same set of samples per group
on the Gym path (the rollout order within a group follows HTTP arrival).

**Media by reference** (``media_by_reference: true``, Gym path). A
:class:`~gymbridge.media.MediaServer` over ``<run_dir>/media_store/`` starts first; the bridge
stores each prompt's inline media once (:class:`~gymbridge.bridge.RowReferencer`) and sends the
G ``/run`` rows with ``http://127.0.0.1:PORT/media/<key>`` references; the agent stores tool
images the same way and replays references; the model server and the bridge trust that host
(``MediaPolicy.media_hosts``) and verify every fetched medium against its key. The training is
the same as with it off (same content keys, tokens, rewards); the payload table's
``gym_request`` / ``gym_return`` rows show media logical / physical = G.

**Run directory, async GRPO, resume.** Every run writes ``config.yaml``, ``dataset.jsonl``,
``metrics.jsonl`` (one record per step, :func:`~gymbridge.launch.rundir.step_record`),
``failures.jsonl`` and ``checkpoints/`` into its run directory (:mod:`gymbridge.launch.rundir`,
printed first, never deleted). ``rollout.max_staleness: k > 0`` lets the rollouts of the next
``k`` batches run while the trainer trains; the generator then samples from its own copy of
the policy, which receives the trainer's weights after every optimizer step (policy version
``v`` = optimizer steps so far), and the bridge drops groups more than ``k`` versions old as
``stale``. ``checkpoint_every: N`` writes :mod:`gymbridge.trainer.checkpoint` checkpoints;
``--resume DIR`` continues from the latest one (the run's own config and dataset), and a run
killed at any moment resumes with each step in ``metrics.jsonl`` once and every dataset row
trained once or recorded in ``failures.jsonl``.

Invariants: nothing is downloaded; nothing listens outside 127.0.0.1; the training step runs
off the event loop so the servers (and, with ``max_staleness > 0``, the next batches'
rollouts) keep going; failed rollouts land in ``<run_dir>/failures.jsonl`` and in the printed
counters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import orjson
import torch
from pydantic import AliasChoices, Field, field_validator, model_validator

from gymbridge.bridge.shaping import ShapingConfig
from gymbridge.cli import load_example_environments
from gymbridge.config import (
    StrictModel,
    merge_overrides,
    parse_override,
    read_config,
    validate_config,
    validate_plain,
)
from gymbridge.errors import ConfigError
from gymbridge.launch.placement import GeneratorConfig
from gymbridge.launch.reporters import ReportTo
from gymbridge.launch.userenv import LauncherModel
from gymbridge.launch.warmup import WarmupConfig
from gymbridge.safe_io import write_atomic
from gymbridge.tensors.batch import AdvantageMode
from gymbridge.trainer.grpo import GRPOConfig, StepMetrics

if TYPE_CHECKING:
    from gymbridge.launch.rundir import RunDir

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CONFIG",
    "RolloutConfig",
    "SmokeConfig",
    "SmokeResult",
    "add_smoke_commands",
    "main",
    "run_smoke",
]

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
"""The configs shipped inside the package (``gymbridge/configs/*.yaml``, package data)."""
DEFAULT_CONFIG = CONFIGS_DIR / "smoke.yaml"
"""What a run uses when given no ``--config``; ``SmokeConfig()``'s defaults are its values (a test)."""


class RolloutConfig(StrictModel):
    """How rollouts are scheduled against training (the ``rollout:`` section)."""

    max_staleness: int = Field(0, ge=0)
    """``k``: 0 trains on-policy (rollouts of a batch start when it is asked for); ``k > 0`` runs the
    next ``k`` batches' rollouts while the trainer trains, and drops (records as ``stale``) a
    trajectory whose oldest turn is more than ``k`` policy versions behind the trainer."""


class SmokeConfig(StrictModel):
    """The launcher's settings (``configs/smoke*.yaml``); every field can be overridden on the CLI.

    The defaults are ``configs/smoke.yaml``'s values (a test checks that they agree)."""

    env: str = "color_pick"
    env_params: dict[str, Any] = Field(
        default_factory=lambda: {"colors": "red,blue", "img_size": 56, "reveal": "prompt", "blank": False}
    )
    """Data-generator parameters (``gymbridge env list --params``)."""
    native: bool = False
    """Native rollouts (``run_episode``) instead of agent + model server."""
    steps: int = Field(100, ge=1)
    prompts_per_step: int = Field(2, ge=1)
    group_size: int = Field(8, ge=1)
    min_group_size: int | None = Field(2, ge=1)
    seed: int = 0
    """Dataset seed, and the sampling seed of the rollouts when ``reproducible``."""
    reproducible: bool = True
    """Seed every rollout's sampling from ``seed`` (see the module docstring)."""
    model: str = "auto"
    """The tiny offline model: ``auto`` (or ``tiny``) takes the Qwen2.5-Omni thinker when the
    environment's modalities include video or audio, else the Qwen2-VL (images);
    ``tiny-qwen2-vl`` / ``tiny-qwen2.5-omni`` choose; anything else is a local Hugging Face model
    directory (:func:`gymbridge.launch.userenv.load_pretrained`)."""
    model_seed: int = 0
    """Seed of the tiny model's random weights."""
    max_tokens: int = Field(4, ge=1)
    """Generation budget per model call (``max_output_tokens`` of each row)."""
    max_turns: int = Field(1, ge=1)
    max_model_len: int = Field(2048, ge=16)
    rollout_deadline_s: float = Field(120.0, gt=0)
    max_consecutive_failed_groups: int = Field(4, ge=1)
    dedup: bool = True
    payload_metrics: bool = True
    media_by_reference: bool = False
    """Gym path: start a media server over ``<run_dir>/media_store/``; each prompt's inline media
    are stored once and the G ``/run`` rows carry ``http://…/media/<key>`` references instead of
    base64 copies (docs/media.md, "Media by reference"). Trains exactly as with it off."""
    dp_workers: int = Field(0, ge=0)
    """0: train in this process; N: N Ray actors in one torch.distributed group (the ``ray`` extra;
    :mod:`gymbridge.trainer.ray_dp`)."""
    ray_num_cpus: int = Field(2, ge=1)
    """CPUs of the local Ray this launcher starts (not used with ``ray_address``)."""
    ray_address: str | None = None
    """Join this Ray cluster (``ray.init(address=...)``, e.g. ``auto``) instead of starting a local one."""
    replay_capacity_groups: int = Field(0, ge=0)
    """> 0: keep a replay buffer (saved in every run checkpoint)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: zero-variance groups are left out (recorded) and replaced by new prompts."""
    dynamic_sampling_max_rounds: int = Field(2, ge=0)
    """Extra rounds of ``prompts_per_step`` prompts one step may draw to replace zero-variance groups
    (the dataset is written that much larger)."""
    run_dir: str | None = Field(None, validation_alias=AliasChoices("run_dir", "work_dir"))
    """The run directory (config.yaml, dataset, metrics.jsonl, failures.jsonl, checkpoints/);
    default ``runs/<env>-<UTC timestamp>``. ``work_dir`` is its deprecated old name."""
    report_to: list[ReportTo] = Field(default_factory=list)
    """Also send each step's metrics record to ``wandb`` / ``tensorboard`` (optional extras)."""
    chart_every: int = Field(5, ge=1)
    """Redraw ``charts/`` every N steps (and at the end); rollouts and the viewer update every step."""
    checkpoint_every: int = Field(0, ge=0)
    """> 0: write a run checkpoint every N steps and after the last one (``--resume`` continues
    from the latest)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward_components_check: Literal["sum", "off"] = "off"
    """``sum``: a result whose ``reward_components`` do not sum to its reward is a failed rollout."""
    advantage: AdvantageMode = "group_norm"
    """Group advantages (``gymbridge.tensors.batch.group_advantages``): ``group_norm`` ``(r - mean) /
    std`` (GRPO), ``group_mean`` ``r - mean`` (no std division: Dr. GRPO; a lone failure among
    correct rollouts gets ``-(G-1)/G`` instead of about ``-2.5`` at G = 8), ``none`` the raw reward."""
    shaping: ShapingConfig = Field(default_factory=lambda: ShapingConfig(kind="none"))
    """Toy dense shaping added to the environment reward (``kind: token_rate`` turns it on)."""
    warmup: WarmupConfig = Field(default_factory=lambda: WarmupConfig(steps=40))
    """Format warm-up before GRPO (:mod:`gymbridge.launch.warmup`; ``steps: 0``: none)."""
    trainer: GRPOConfig = Field(
        default_factory=lambda: GRPOConfig(
            lr=2e-3,
            lr_warmup_steps=10,
            lr_schedule="cosine",
            lr_decay_steps=100,
            lr_min_ratio=0.1,
            adam_eps=1e-5,
        )
    )
    """``trainer.temperature`` and ``trainer.top_p`` are also the rollouts' sampling settings (every
    dataset row gets them; a row asking for another ``top_p`` is a ``ConfigError``)."""
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    """Where the generator runs (``placement: in_process | process``) and weight publication."""
    agent_url: str | None = None
    """A running NeMo Gym agent (``POST /run``; a genuine nemo-gym one included): the run starts no
    environment and no agent, only the model server that agent calls (``model_port``)."""
    dataset: str | None = None
    """NeMo Gym rows (jsonl) to train on; default: rows generated by the example environment."""
    backend: Literal["hf", "vllm"] = "hf"
    """Generation backend of ``model: PATH``: ``vllm`` (GPU) serves it with vLLM in a child process."""
    model_port: int = Field(0, ge=0, le=65535)
    """Port of the model server the run starts (0: a free one); a separate agent is configured with it."""
    force_first_call: str | None = None
    """``native: true`` only: the text the first model call of every rollout emits (tokenized, plus end
    of turn; scored, not sampled: ``gymbridge.rollout.episode``), e.g. the ``look`` call of
    ``configs/smoke_color_tool.yaml``; every later call samples. ``None``: every call samples."""
    withhold_later_media: bool = False
    """Debug control (``native: true`` only): the generator's input keeps only the media of the
    first model call's prompt; a tool's later image is withheld from it (placeholders removed) while
    the trained turns keep it (``gymbridge.rollout.episode``, the stale-prompt control). A policy
    that must read a tool's image then stays at chance (``configs/smoke_color_tool.yaml``)."""

    @field_validator("run_dir")
    @classmethod
    def _run_dir_is_not_a_file(cls, value: str | None) -> str | None:
        if value is not None and Path(value).exists() and not Path(value).is_dir():
            raise ValueError(f"{value} is a file, not a folder: give a new or existing directory")
        return value

    @field_validator("model")
    @classmethod
    def _model_is_tiny_or_a_directory(cls, value: str) -> str:
        from gymbridge.launch.userenv import TINY_MODELS

        if value not in TINY_MODELS and not Path(value).is_dir():
            raise ValueError(f"{value!r} is neither one of {', '.join(TINY_MODELS)} nor a model directory")
        return value

    @model_validator(mode="after")
    def _group_sizes(self) -> SmokeConfig:
        # checked here, when the config loads: before any server starts
        if self.min_group_size is not None and self.min_group_size > self.group_size:
            raise ValueError(
                f"min_group_size ({self.min_group_size}) is larger than group_size ({self.group_size})"
            )
        if self.trainer.dtype != "float32" and self.generator.placement == "process":
            raise ValueError(
                f"trainer.dtype={self.trainer.dtype} with generator.placement=process: the model server "
                "process builds its model in float32, so the published weights would not fit it; "
                "use generator.placement=in_process (its generator is built in the trainer's dtype)"
            )
        if self.force_first_call is not None and not self.native:
            raise ValueError("force_first_call needs native: true (it forces the native generator's output)")
        if self.withhold_later_media and not self.native:
            raise ValueError("withhold_later_media needs native: true (it edits the native input)")
        return self


@dataclass
class SmokeResult:
    """What a smoke run produced (the printed numbers, kept for tests and scripts)."""

    steps: list[StepMetrics] = field(default_factory=list)
    env_rewards: list[float] = field(default_factory=list)
    """Mean environment reward of each step's trained rollouts."""
    shaping_rewards: list[float] = field(default_factory=list)
    """Mean shaping bonus of each step's trained rollouts (0.0 without shaping)."""
    media_keys: list[dict[str, list[str]]] = field(default_factory=list)
    """Each step's trained media keys by modality (``TrainBatch.media_keys()``)."""
    rollouts_ok: int = 0
    rollouts_failed: int = 0
    bridge_stats: dict[str, Any] = field(default_factory=dict)
    payload_table: str = ""
    model_media_cache: dict[str, Any] = field(default_factory=dict)
    """The model server's media cache counters at the end (``GET /media_cache``; Gym path)."""
    urls: dict[str, str] = field(default_factory=dict)
    """The servers this run started (all stopped when it returns)."""
    run_dir: str = ""
    records: list[dict[str, Any]] = field(default_factory=list)
    """This process's ``metrics.jsonl`` records (a resumed run: the steps it ran)."""
    resumed_from_step: int = 0
    elapsed_s: float = 0.0
    model_server_pid: int | None = None
    """The child model server's pid with ``generator.placement: process`` (stopped on return)."""


_TINY_NAMES = ("tiny-qwen2-vl", "tiny-qwen2.5-omni")


def _pick_model(cfg: SmokeConfig, spec: Any) -> LauncherModel:
    """The model for ``cfg.model`` (``auto``: the tiny one by the env's modalities, see ``SmokeConfig``)."""
    from gymbridge.launch.userenv import TINY_MODELS, load_pretrained
    from gymbridge.trainer.models import tiny_omni_policy, tiny_policy

    choice = cfg.model
    if choice not in TINY_MODELS:  # a local model directory
        return load_pretrained(choice, cfg.backend)
    if choice in ("auto", "tiny"):
        modalities = set(spec.modalities) if spec is not None else set()  # None: an agent's env (images)
        choice = "tiny-qwen2.5-omni" if {"video", "audio"} & modalities else "tiny-qwen2-vl"
    if choice == "tiny-qwen2.5-omni":
        from gymbridge.testing.tiny_omni import build_tiny_omni

        omni = build_tiny_omni(cfg.model_seed)
        return LauncherModel(
            f"gymbridge-tiny-qwen2.5-omni-seed{cfg.model_seed}",
            omni.processor,
            omni.tokenizer,
            tiny_omni_policy(cfg.model_seed),
            omni.placeholder_token_ids,
            tiny_omni_policy,
            "--tiny-omni",
        )
    from gymbridge.testing.tiny_vlm import build_tiny_vlm

    vlm = build_tiny_vlm(cfg.model_seed)
    return LauncherModel(
        f"gymbridge-tiny-qwen2-vl-seed{cfg.model_seed}",
        vlm.processor,
        vlm.tokenizer,
        tiny_policy(cfg.model_seed),
        (vlm.image_token_id, vlm.video_token_id),
        tiny_policy,
        "--tiny",
    )


def _media_summary(batch: Any) -> str:
    """``media video: pixel_values_videos, video_grid_thw, video_second_per_grid (2 unique)`` for a batch."""
    keys = batch.media_keys()
    if not keys:
        return ""
    unique = batch.media_content_keys()
    parts = [
        f"{modality}: {', '.join(names)} ({len(unique.get(modality, []))} unique)"
        for modality, names in sorted(keys.items())
    ]
    return "  media " + "; ".join(parts)


def _write_dataset(cfg: SmokeConfig, spec: Any, path: Path) -> int:
    spec.check_params(cfg.env_params)
    n = cfg.steps * cfg.prompts_per_step
    if cfg.dynamic_sampling:  # each batch may draw that many extra rounds of prompts
        n *= 1 + cfg.dynamic_sampling_max_rounds
    try:
        rows = list(spec.generate(n, cfg.seed, **cfg.env_params))
    except (TypeError, ValueError) as exc:  # a generator refusing its parameters
        raise ConfigError([f"env_params: {cfg.env} generator: {exc}"]) from exc
    lines = [_row_line(cfg, row, f"{cfg.env} row {index}") for index, row in enumerate(rows)]
    write_atomic(path, lines)  # a run killed here resumes with the whole dataset or writes it again
    return n


def _copy_dataset(cfg: SmokeConfig, rows: list[bytes], path: Path) -> int:
    """The user's rows (:func:`~gymbridge.launch.userenv.read_dataset`) into the run, defaults filled."""
    lines = [_row_line(cfg, orjson.loads(line), f"{cfg.dataset} line {i}") for i, line in enumerate(rows, 1)]
    write_atomic(path, lines)
    return len(lines)


def _row_line(cfg: SmokeConfig, row: dict[str, Any], where: str) -> bytes:
    """``row`` as a dataset line with the run's sampling defaults; a row asking for another
    ``top_p`` than the trainer scores with is a ``ConfigError`` (the ratio would be biased)."""
    rcp = dict(row["responses_create_params"])
    # sampling settings are valid Responses-API fields of the dataset row itself
    rcp.setdefault("max_output_tokens", cfg.max_tokens)
    rcp.setdefault("temperature", cfg.trainer.temperature)
    top_p = cfg.trainer.top_p
    if top_p != 1.0:
        rcp.setdefault("top_p", top_p)
    if rcp.get("top_p", 1.0) != top_p:
        raise ConfigError(
            [
                f"trainer.top_p: {where} asks for top_p={rcp['top_p']} but the trainer "
                f"scores with top_p={top_p}: the ratio would be biased; set trainer.top_p to the rows'"
            ]
        )
    return orjson.dumps({**row, "responses_create_params": rcp}) + b"\n"


def _group_rewards(groups: list[Any]) -> tuple[float, float]:
    """Mean environment reward and mean shaping bonus over the trained trajectories of ``groups``."""
    env: list[float] = []
    bonus: list[float] = []
    for g in groups:
        if g.batch is None:
            continue
        for traj in g.trajectories:
            base = float(traj.metadata.get("env_reward", traj.reward))
            env.append(base)
            bonus.append(float(traj.reward) - base)
    if not env:
        return 0.0, 0.0
    return sum(env) / len(env), sum(bonus) / len(bonus)


def _forced_tokens(text: str | None, generator: Any) -> list[int] | None:
    """``text`` as the generator's tokens plus its end of turn (``force_first_call``)."""
    if text is None:
        return None
    ids = [int(t) for t in generator.tokenizer(text, add_special_tokens=False)["input_ids"]]
    return [*ids, generator.codec.end_of_turn_id]


def _placement_line(handle: Any, sync_s: float) -> str:
    where = "in this process" if handle.placement == "in_process" else f"process {handle.pid}"
    if handle.publisher is None:
        return f"generator: {where}; weight publication OFF (the generator keeps the step-0 weights)"
    how = "copy" if handle.placement == "in_process" else "torch.distributed broadcast"
    return f"generator: {where}; weights published after every step ({how}); v0 in {sync_s:.3f}s"


def _step_line(
    step: int, total: int, m: StepMetrics, ok: int, failed: int, env: float, shaped: float | None
) -> str:
    rewards = f"env reward {env:.3f}" + (f"  shaped reward {shaped:.3f}" if shaped is not None else "")
    loss = m.loss if abs(m.loss) >= 5e-6 else 0.0  # no "-0.00000" vs "+0.00000" flicker between reruns
    return (
        f"step {step}/{total}  {rewards}  loss {loss:+.5f}  tokens {m.num_tokens} "
        f"(trained {m.num_loss_tokens})  grad_norm {m.grad_norm:.4f}  ratio {m.mean_ratio:.4f}  "
        f"ratio_mean {m.ratio_mean:.5f}  rollouts {ok} ok / {failed} failed  {m.elapsed_s:.2f}s train"
        f"{_sync_text(m)}"
    )


def _policy_in_dtype(factory: Callable[[int], Any], dtype: torch.dtype, seed: int) -> Any:
    """``factory(seed)`` cast to ``dtype`` (the in-process generator's model, in the trainer's dtype)."""
    return factory(seed).to(dtype)


def _dp_keys(dp: Any) -> dict[str, Any]:
    """The ``metrics.jsonl`` keys of a data-parallel step (none without DP)."""
    if dp is None:
        return {}
    return {
        "dp_backend": dp.backend,
        "dp_world_size": dp.num_workers,
        "dp_shard_tokens": list(dp.last_shard_tokens),
        "dp_media_dtypes": dict(dp.last_media_dtypes),
        "dp_weights_s": dp.last_weights_s,
    }


def _variant_text(cfg: SmokeConfig, m: StepMetrics, record: dict[str, Any]) -> str:
    """The step line's part for the GRPO variants that are on (lr schedule, KL, overlong masking, DAPO)."""
    text = ""
    if cfg.trainer.lr_scheduled:
        text += f"  lr {m.lr:.2e}"
    if cfg.trainer.kl_coef > 0:
        text += f"  kl {m.kl:.5f} ({cfg.trainer.kl_estimator})"
    if cfg.trainer.mask_truncated:
        text += f"  truncated masked {m.truncated_masked}"
    if cfg.dynamic_sampling:
        text += f"  zero-variance dropped {record['groups_zero_variance_dropped']}"
    return text


def _sync_text(m: StepMetrics) -> str:
    """``  -> v3 (sync 0.021s)``: the version published after the step and what it cost."""
    if m.policy_version is None:
        return ""
    return f"  -> v{m.policy_version} (sync {m.weight_sync_s:.3f}s)"


async def _model_media_cache(model_url: str, out: IO[str]) -> dict[str, Any]:
    """The model server's ``GET /media_cache`` counters, printed as one line ({} when unavailable)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
            reply = await http.get(f"{model_url}/media_cache")
        stats: dict[str, Any] = reply.json() if reply.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        stats = {}
    kinds = stats.get("kinds") or {}
    if kinds:
        shown = ", ".join(f"{kind} {k['misses']} miss / {k['hits']} hit" for kind, k in sorted(kinds.items()))
        print(
            f"model server media cache (once per content key): {shown}; "
            f"{stats.get('bytes', 0) / 2**20:.1f} MiB held",
            file=out,
        )
    return stats


async def _run(cfg: SmokeConfig, out: IO[str], progress: bool, run: RunDir, resume: bool) -> SmokeResult:
    from tqdm.auto import tqdm

    from gymbridge.bridge import (
        BridgeIterator,
        GymRollouts,
        NativeRollouts,
        ReplayBuffer,
        TokenRateShaping,
    )
    from gymbridge.launch.artifacts import RunArtifacts
    from gymbridge.launch.placement import start_generator
    from gymbridge.launch.reporters import open_reporters
    from gymbridge.launch.rundir import payload_delta, step_record
    from gymbridge.launch.userenv import UserEnv, read_dataset, resolve_env
    from gymbridge.media import MediaPolicy
    from gymbridge.metrics import PayloadMeter
    from gymbridge.server import start_server
    from gymbridge.tensors import MediaProcessor
    from gymbridge.trainer.checkpoint import RunState, load_checkpoint, save_checkpoint
    from gymbridge.trainer.grpo import GRPOTrainer
    from gymbridge.trainer.loop import train_step
    from gymbridge.trainer.models import from_config

    started = time.perf_counter()
    result = SmokeResult(run_dir=str(run.path))
    # None: an external agent (agent_url) holds the environment; UserEnv: a user's module:Class
    spec = resolve_env(cfg.env) if cfg.agent_url is None else None
    dataset = run.dataset_path
    if resume and dataset.is_file():
        n_rows = sum(1 for line in dataset.read_bytes().splitlines() if line.strip())
        print(f"dataset: {n_rows} {cfg.env} rows (the run's own) -> {dataset}", file=out)
    elif cfg.dataset is not None:
        n_rows = _copy_dataset(cfg, read_dataset(cfg.dataset), dataset)
        print(f"dataset: {n_rows} rows from {cfg.dataset} -> {dataset}", file=out)
    elif spec is None or isinstance(spec, UserEnv):
        raise ConfigError(
            [f"{cfg.agent_url or cfg.env}: no data generator here; give dataset= (NeMo Gym rows)"]
        )
    else:
        n_rows = _write_dataset(cfg, spec, dataset)
        print(f"dataset: {n_rows} {cfg.env} rows -> {dataset}", file=out)

    tiny = _pick_model(cfg, spec)
    policy = tiny.policy  # the trainer's; the generator holds a model of its own
    origin = "random weights, offline" if cfg.model in ("auto", "tiny", *_TINY_NAMES) else "local directory"
    print(f"model: {tiny.name} ({origin})", file=out)
    meter = PayloadMeter(enabled=cfg.payload_metrics)
    shaping = TokenRateShaping.from_config(cfg.shaping, tiny.tokenizer)
    if shaping is not None:
        print(
            f"shaping: toy dense reward added to the env reward: {shaping.weight:g} x fraction of generated "
            f"tokens made of {shaping.chars!r} ({len(shaping.token_ids)} token ids)",
            file=out,
        )
    dtype = cfg.trainer.torch_dtype
    if resume:  # the checkpoint holds weights and optimizer state in the trainer's dtype
        policy.to(dtype)
    # the drift guard (ratio 1 before the update) holds only on-policy; running ahead it is reported
    trainer = GRPOTrainer(policy, cfg.trainer, on_policy=cfg.rollout.max_staleness == 0)
    step_trainer: Any = trainer
    state: RunState | None = None
    replay = ReplayBuffer(cfg.replay_capacity_groups, meter=meter) if cfg.replay_capacity_groups else None
    if resume:
        loaded = load_checkpoint(run.checkpoints_path, trainer=trainer, meter=meter)
        if loaded is not None:
            state, saved_replay = loaded
            replay = saved_replay if saved_replay is not None else replay
        if state is None or state.step < cfg.steps:  # a finished run keeps its records as they are
            run.rewind(
                last_step=state.step if state else 0,
                done_task_indices=state.done_task_indices if state else (),
            )
        print(
            f"resumed: step {state.step}/{cfg.steps}, policy version {state.policy_version}, "
            f"{len(state.done_task_indices)} row(s) done ({state.path.name})"
            if state is not None
            else "resumed: no checkpoint yet, starting from step 1",
            file=out,
        )
    if not resume and spec is not None:  # a resumed run's checkpoint holds the warmed-up weights
        from gymbridge.generation.hf import HFGenerator
        from gymbridge.launch.warmup import warmup_for_env

        # trains the trainer's policy (rendered as the generator renders); v0 publication copies it over
        renderer = HFGenerator(policy, tiny.processor, max_model_len=cfg.max_model_len)
        warm = await asyncio.to_thread(
            warmup_for_env,
            spec,
            cfg.env_params,
            policy,
            renderer,
            cfg.warmup,
            forced_first_call=cfg.force_first_call,
        )
        if trainer.reference is not None:  # KL to the policy RL starts from: the warmed-up one
            trainer.freeze_reference()
        if warm is not None and warm.examples == 0:
            print(
                f"format warm-up: nothing to train, its {warm.skipped} target(s) are all the forced "
                "first call (never sampled)",
                file=out,
            )
        elif warm is not None:
            print(
                f"format warm-up: {warm.steps} supervised steps, {warm.examples} image-independent targets"
                + (f" ({warm.skipped} of the forced first call left out)" if warm.skipped else "")
                + f", loss {warm.first_loss:.3f} -> {warm.last_loss:.3f} ({warm.elapsed_s:.1f}s)",
                file=out,
            )
        policy.to(dtype)  # in place (the optimizer's parameters stay the same objects; no state yet)
    if dtype != torch.float32:
        print(f"policy dtype: {cfg.trainer.dtype} (trainer and generator)", file=out)
    version = state.policy_version if state is not None else 0

    async with contextlib.AsyncExitStack() as stack:
        env_url = ""
        if spec is not None:
            env = await start_server(spec.make_server())
            stack.push_async_callback(env.stop)
            result.urls["environment"] = env_url = env.url
        media_server = None
        if cfg.media_by_reference and cfg.native:
            print("media by reference: off on the native path (no Gym request to shrink)", file=out)
        elif cfg.media_by_reference:
            from gymbridge.media import MediaServer, MediaStore

            media_server = MediaServer(MediaStore(run.path / "media_store"))
            media_server.start()
            stack.callback(media_server.stop)
            result.urls["media"] = media_server.base_url
            meter.media_size = media_server.store.size
        media_hosts = (media_server.host_entry,) if media_server is not None else ()
        handle = await start_generator(
            cfg.generator,
            stack,
            serve=not cfg.native,
            model_seed=cfg.model_seed,
            processor=tiny.processor,
            max_model_len=cfg.max_model_len,
            default_max_tokens=cfg.max_tokens,
            prompt_seed=cfg.seed if cfg.reproducible and not cfg.native else None,
            model_name=tiny.name,
            policy_factory=functools.partial(_policy_in_dtype, tiny.policy_factory, dtype),
            serve_flag=tiny.serve_flag,
            log_dir=run.path,
            port=cfg.model_port,
            media_hosts=media_hosts,
        )
        result.model_server_pid = handle.pid
        source: Any
        if cfg.native:
            assert handle.generator is not None  # native runs keep the generator in this process
            source = NativeRollouts(
                handle.generator,
                env_url,
                max_turns=cfg.max_turns,
                timeout_s=cfg.rollout_deadline_s,
                meter=meter,
                seed=cfg.seed if cfg.reproducible else None,
                # the env's declared style, not a guess from the row (a tool env may offer no tools)
                mode="gymnasium" if spec is not None and spec.style == "gymnasium" else "tools",
                withhold_token_ids=(
                    handle.generator.suppressed_token_ids if cfg.withhold_later_media else None
                ),
                forced_first_call=_forced_tokens(cfg.force_first_call, handle.generator),
            )
            if cfg.force_first_call is not None:
                print(
                    f"force_first_call: every rollout's first model call is {cfg.force_first_call!r}",
                    file=out,
                )
            if cfg.withhold_later_media:
                print(
                    "withhold_later_media: the generator does not see media that arrive after the first "
                    "model call (the stale-prompt control); the trained turns keep them",
                    file=out,
                )
        else:
            from gymbridge.client import GymClient
            from gymbridge.server import SimpleAgent

            model_url = str(handle.model_url)
            agent_url = cfg.agent_url
            if spec is not None:
                agent = SimpleAgent(
                    resources_url=env_url,
                    model_url=model_url,
                    gymnasium=spec.style == "gymnasium",
                    max_steps=cfg.max_turns,
                    model_timeout_s=cfg.rollout_deadline_s,
                    media_store_url=media_server.base_url if media_server is not None else None,
                    meter=meter,
                )
                agent_running = await start_server(agent)
                stack.push_async_callback(agent_running.stop)
                agent_url = agent_running.url
            assert agent_url is not None
            client = GymClient(agent_url, deadline_s=cfg.rollout_deadline_s)
            stack.push_async_callback(client.aclose)
            referencer = None
            if media_server is not None:
                from gymbridge.bridge import RowReferencer

                referencer = RowReferencer(media_server.store, media_server.url_for)
            source = GymRollouts(
                client, deadline_s=cfg.rollout_deadline_s, meter=meter, referencer=referencer
            )
            result.urls.update(model=model_url, agent=agent_url)
        stack.push_async_callback(source.aclose)
        print("servers: " + ", ".join(f"{k} {v}" for k, v in result.urls.items()), file=out)
        # version 0: the initial weights (a resumed run: its checkpoint's weights and version)
        sync_s = await asyncio.to_thread(handle.publish, policy, version)
        print(_placement_line(handle, sync_s), file=out)

        dp: Any = None
        if cfg.dp_workers > 0:
            from gymbridge.trainer.ray_dp import RayDPTrainer, init_ray, require_ray

            try:
                ray = require_ray()
            except ImportError as exc:
                raise ConfigError([f"dp_workers={cfg.dp_workers}: {exc}"]) from exc
            if not ray.is_initialized():
                init_ray(cfg.ray_num_cpus, address=cfg.ray_address)
                stack.callback(ray.shutdown)  # ours: stopped after the workers (LIFO)
            dp = step_trainer = RayDPTrainer(
                trainer,
                functools.partial(from_config, type(policy), policy.config),
                cfg.dp_workers,
                meter=meter,
            )
            stack.callback(step_trainer.shutdown)
            print(
                f"data parallel: {cfg.dp_workers} Ray worker(s) in one torch.distributed group "
                f"({dp.backend}, {dp.num_gpus:g} GPU each); gradients all-reduced in the group, "
                "rank 0's weights published",
                file=out,
            )
        bridge = BridgeIterator(
            dataset,
            source,
            MediaProcessor(tiny.processor),
            group_size=cfg.group_size,
            prompts_per_batch=cfg.prompts_per_step,
            min_group_size=cfg.min_group_size,
            max_consecutive_failed_groups=cfg.max_consecutive_failed_groups,
            dedup=cfg.dedup,
            reward_components_check=cfg.reward_components_check,
            advantage=cfg.advantage,
            failures_path=run.failures_path,
            meter=meter,
            media_policy=MediaPolicy(media_hosts=media_hosts) if media_hosts else None,
            replay=replay,
            placeholder_token_ids=list(tiny.placeholder_token_ids),
            reward_fn=shaping,
            max_staleness=cfg.rollout.max_staleness,
            skip_task_indices=state.done_task_indices if state is not None else (),
            # on-policy with the drift guard on, a lagging generator must fail the step loudly
            drop_stale=cfg.rollout.max_staleness > 0 or cfg.trainer.ratio_tolerance is None,
            dynamic_sampling=cfg.dynamic_sampling,
            dynamic_sampling_max_rounds=cfg.dynamic_sampling_max_rounds,
        )
        stack.push_async_callback(bridge.aclose)
        artifacts = RunArtifacts(run.path, decode=tiny.tokenizer.decode, chart_every=cfg.chart_every)
        reporters = open_reporters(cfg.report_to, run.path, cfg.model_dump(mode="json"))
        for reporter in reporters:
            stack.callback(reporter.close)
        first = state.step + 1 if state is not None else 1
        result.resumed_from_step = first - 1
        if first > cfg.steps:
            print(f"nothing left to run: all {cfg.steps} step(s) are done", file=out)
        bar = tqdm(total=cfg.steps, initial=first - 1, desc="smoke", unit="step", disable=not progress)
        stack.callback(bar.close)
        publish = functools.partial(handle.publish, policy)
        for step in range(first, cfg.steps + 1):
            before_ok, before_failed = bridge.stats.rollouts_ok, bridge.stats.rollouts_failed
            payload_before = meter.report()
            done = await train_step(bridge, step_trainer.step, policy_version=version, publish=publish)
            if done is None:
                print(f"the dataset ran out after {step - 1} step(s)", file=out)
                break
            version = done.policy_version
            metrics = dataclasses.replace(
                done.metrics, policy_version=version, weight_sync_s=done.weight_sync_s
            )
            result.steps.append(metrics)
            result.media_keys.append(done.batch.media_keys())
            ok = bridge.stats.rollouts_ok - before_ok
            failed = bridge.stats.rollouts_failed - before_failed
            env_mean, bonus_mean = _group_rewards(bridge.last_groups)
            result.env_rewards.append(env_mean)
            result.shaping_rewards.append(bonus_mean)
            record = step_record(
                step,
                metrics,
                groups=bridge.last_groups,
                dropped_stale=bridge.last_dropped_stale,
                dropped_zero_variance=bridge.last_dropped_zero_variance,
                policy_version=version,
                rollouts_ok=ok,
                rollouts_failed=failed,
                weight_sync_s=done.weight_sync_s,
                step_s=done.step_s,
                payload=payload_delta(payload_before, meter.report()),
                env_reward_mean=env_mean,
                shaping_reward_mean=bonus_mean,
                media_tensors=done.batch.media_keys(),
                **_dp_keys(dp),
            )
            run.append_metrics(record)
            result.records.append(record)
            await asyncio.to_thread(artifacts.record_step, step, bridge.last_groups, run.metrics())
            for reporter in reporters:
                reporter.log(step, record)
            bar.update(1)
            bar.clear()
            line = _step_line(
                step, cfg.steps, metrics, ok, failed, env_mean, bonus_mean if shaping is not None else None
            )
            if handle.publisher is None:
                line += " (not published: generator.publish_weights is off)"
            if cfg.rollout.max_staleness > 0:
                line += f"  staleness {record['staleness_max']} (dropped {record['groups_dropped_stale']})"
            line += _variant_text(cfg, metrics, record)
            print(line + _media_summary(done.batch), file=out, flush=True)
            if cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
                if dp is not None:  # the driver holds rank 0's weights; its optimizer state too now
                    await asyncio.to_thread(dp.pull_optimizer_state)
                await asyncio.to_thread(
                    save_checkpoint,
                    run.checkpoints_path,
                    step=step,
                    policy_version=version,
                    trainer=trainer,
                    done_task_indices=set(bridge.done_task_indices),
                    replay=replay,
                )
        bar.close()
        if not cfg.native:
            result.model_media_cache = await _model_media_cache(str(handle.model_url), out)
        result.rollouts_ok = bridge.stats.rollouts_ok
        result.rollouts_failed = bridge.stats.rollouts_failed
        result.bridge_stats = bridge.stats.as_dict()
    if result.steps:
        n = len(result.steps)
        env_first, env_last = result.env_rewards[0], result.env_rewards[-1]
        if shaping is not None:
            first_r, last_r = result.shaping_rewards[0], result.shaping_rewards[-1]
            print(
                f"\nshaped reward {first_r:.3f} -> {last_r:.3f} over {n} steps "
                f"(toy token_rate {shaping.chars!r}); env reward {env_first:.3f} -> {env_last:.3f}",
                file=out,
            )
        else:
            print(f"\nenv reward {env_first:.3f} -> {env_last:.3f} over {n} steps", file=out)
    if cfg.payload_metrics:
        result.payload_table = meter.table()
        print("\npayload per boundary (pickle-5 bytes; ratio = logical / physical media bytes):", file=out)
        print(result.payload_table, file=out)
    result.elapsed_s = time.perf_counter() - started
    s = result.bridge_stats
    stale = f", {s['groups_dropped_stale']} stale" if s.get("groups_dropped_stale") else ""
    print(
        f"\ndone: {len(result.steps)} step(s), {result.rollouts_ok} rollouts ok, "
        f"{result.rollouts_failed} failed ({s.get('groups_failed', 0)} failed group(s), "
        f"{s.get('groups_zero_variance', 0)} zero-variance{stale}"
        f"{_dropped_zero_variance_text(s)}), "
        f"{result.elapsed_s:.1f}s total; metrics: {run.metrics_path}, failures: {run.failures_path}",
        file=out,
    )
    artifacts.finish(run.metrics())
    print(f"charts: {artifacts.charts_path}/\nviewer: {artifacts.viewer_path}", file=out, flush=True)
    return result


def _dropped_zero_variance_text(stats: dict[str, Any]) -> str:
    dropped = stats.get("groups_zero_variance_dropped", 0)
    return f", {dropped} zero-variance dropped by dynamic sampling" if dropped else ""


def run_smoke(
    cfg: SmokeConfig, *, out: IO[str] | None = None, progress: bool = False, resume: bool = False
) -> SmokeResult:
    """Run the smoke launcher to completion (its own event loop); every server is stopped on return.

    The run directory (``cfg.run_dir``, default ``runs/<env>-<UTC timestamp>``) is printed first
    and kept. ``resume=True`` continues the run in ``cfg.run_dir`` from its latest checkpoint.
    """
    from gymbridge.launch.rundir import RunDir, default_run_dir

    out = out if out is not None else sys.stdout
    _check_setup(cfg)
    name = "agent" if cfg.agent_url is not None else cfg.env.replace(":", "-").replace("/", "-")
    path = Path(cfg.run_dir) if cfg.run_dir is not None else default_run_dir(name)
    print(f"run dir: {path}", file=out, flush=True)
    run = RunDir(path)
    if resume:
        if not run.config_path.is_file():
            raise ConfigError([f"--resume {path}: not a run directory (no config.yaml)"])
    elif run.metrics() or (run.checkpoints_path / "latest.json").exists():
        raise ConfigError(
            [f"run_dir {path} already holds a run: continue it with --resume {path} or pick another run_dir"]
        )
    run = RunDir.create(path)
    cfg = cfg.model_copy(update={"run_dir": str(path)})
    if not resume:
        run.write_config(cfg.model_dump(mode="json"))
    return asyncio.run(_run(cfg, out, progress, run, resume))


def _check_setup(cfg: SmokeConfig) -> None:
    """Refuse, before anything starts, the combinations of a user's setup that cannot run."""
    from gymbridge.launch.userenv import TINY_MODELS, require_vllm

    problems: list[str] = []
    if cfg.agent_url is not None and cfg.native:
        problems.append(
            "agent_url: native rollouts drive the environment themselves; drop native or agent_url"
        )
    if cfg.agent_url is not None and cfg.dataset is None:
        problems.append("agent_url: give dataset= (the NeMo Gym rows the agent runs)")
    if cfg.backend == "vllm":
        if cfg.model in TINY_MODELS:
            problems.append(
                "backend=vllm serves a model directory: give model=PATH (the tiny models are hf only)"
            )
        if cfg.generator.placement != "process":
            problems.append(
                "backend=vllm runs the model server as its own process: set generator.placement=process"
            )
    if problems:
        raise ConfigError(problems)
    if cfg.backend == "vllm":
        require_vllm()


def resume_config(run_dir: str | Path) -> SmokeConfig:
    """The config of the run in ``run_dir`` (its ``config.yaml``), pointed at ``run_dir``."""
    from gymbridge.launch.rundir import RunDir

    run = RunDir(Path(run_dir))
    data = run.read_config()
    data["run_dir"] = str(run_dir)
    # saved resolved: a literal "${" in it is text, never interpolated again
    return validate_plain(data, SmokeConfig, where=str(run.config_path))


# ------------------------------------------------------------------------ CLI
OTHER_ENV_DEFAULTS: dict[str, Any] = {
    "env_params": {},
    "max_turns": 2,
    "max_tokens": 16,
    "shaping": {"kind": "none"},
    "warmup": {"steps": 0},
}
"""What ``--env NAME`` resets (the config file's values are for its own env); the environment's
``LAUNCHER_DEFAULTS`` override these."""


def config_path(name: str | Path) -> Path:
    """``--config``'s argument as a file: a path, or the name of a shipped config (``smoke_ray``)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = CONFIGS_DIR / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    # a bare name, or the old checkout path configs/NAME.yaml (the configs moved into the package)
    if path.parent in (Path("."), Path("configs")) and shipped.is_file():
        return shipped
    return path  # read_config names the file it cannot read


def build_config(
    config_path_or_name: str | Path | None,
    overrides: Sequence[str | tuple[str, Any]],
    flags: dict[str, Any],
) -> SmokeConfig:
    """Load the config (default: the shipped ``gymbridge/configs/smoke.yaml``), merge ``--set`` and flags.

    ``--set`` overrides are OmegaConf dot-lists (``trainer.lr=1e-3``), merged over the file; the
    flags (``--steps``, ...) come last. ``--env`` naming another environment than the file's drops
    the file's ``env_params`` (they are that environment's generator parameters); ``--set
    env_params.X=...`` still applies. Interpolations resolve after every merge, then pydantic
    validates (:func:`gymbridge.config.validate_config`).
    """
    path = config_path(config_path_or_name) if config_path_or_name is not None else DEFAULT_CONFIG
    where = str(path)
    conf = read_config(path)
    env_flag = flags.get("env")
    other_env = env_flag is not None and env_flag != conf.get("env", SmokeConfig.model_fields["env"].default)
    if other_env or (flags.get("agent_url") and not conf.get("agent_url")):
        # another environment than the file's (or an agent's own): its own defaults, not the
        # file's settings for another one
        defaults = {
            **OTHER_ENV_DEFAULTS,
            **(environment_launcher_defaults(str(env_flag)) if other_env else {}),
        }
        for key in OTHER_ENV_DEFAULTS:
            conf.pop(key, None)
        conf.merge_with(defaults)
    conf = merge_overrides(conf, overrides, where=where)
    conf.merge_with({k: v for k, v in flags.items() if v is not None})
    return validate_config(conf, SmokeConfig, where=where)


def environment_launcher_defaults(env: str) -> dict[str, Any]:
    """The launcher defaults of environment ``env`` (an example environment's ``LAUNCHER_DEFAULTS``)."""
    from gymbridge.launch.userenv import is_class_ref

    if is_class_ref(env):
        return {}  # a user's server class: the generic defaults
    return dict(load_example_environments().get_env(env).launcher_defaults())


def add_smoke_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's options, on any parser."""
    parser.add_argument(
        "--config",
        default=None,
        help=f"YAML config: a file or a shipped config's name (default {DEFAULT_CONFIG.stem})",
    )
    parser.add_argument(
        "--native", action="store_true", default=None, help="native rollouts (no agent/model server)"
    )
    parser.add_argument("--env", default=None, help="example environment (default circle_click)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps")
    parser.add_argument("--prompts", dest="prompts_per_step", type=int, default=None, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=None, help="rollouts per prompt (G)")
    parser.add_argument("--seed", type=int, default=None, help="dataset and sampling seed")
    parser.add_argument("--dp", dest="dp_workers", type=int, default=None, help="Ray DP workers (0: none)")
    parser.add_argument(
        "--run-dir",
        dest="run_dir",
        default=None,
        help="the run directory (default runs/<env>-<UTC timestamp>): config, metrics, failures, checkpoints",
    )
    parser.add_argument("--work-dir", dest="run_dir", default=None, help=argparse.SUPPRESS)  # old name
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        type=Path,
        default=None,
        help="continue the run in RUN_DIR from its latest checkpoint (with the config saved there)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        type=parse_override,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key (OmegaConf dot-list: dotted, YAML-typed), e.g. --set trainer.lr=1e-3",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=_cmd_smoke)


def _cmd_smoke(args: argparse.Namespace) -> int:
    flags = {
        k: getattr(args, k)
        for k in (
            "native",
            "env",
            "steps",
            "prompts_per_step",
            "group_size",
            "seed",
            "dp_workers",
            "run_dir",
        )
    }
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per /run call drowns the steps
    if args.resume is not None:
        given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None]
        given += [f"--set {o.partition('=')[0]}" for o in args.overrides] + (
            ["--config"] if args.config else []
        )
        if given:
            raise ConfigError(
                [f"--resume continues the run as saved in {args.resume}/config.yaml; drop {', '.join(given)}"]
            )
        run_smoke(resume_config(args.resume), progress=not args.no_progress, resume=True)
        return 0
    cfg = build_config(args.config, args.overrides, flags)
    run_smoke(cfg, progress=not args.no_progress)
    return 0


def add_smoke_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``smoke run`` under a command group (the ``gymbridge.cli`` dispatch-table hook)."""
    p_run = sub.add_parser("run", help="run the end-to-end smoke on loopback (env + agent + model + GRPO)")
    add_smoke_arguments(p_run)


def main(argv: list[str] | None = None) -> int:
    """``python -m gymbridge.launch.smoke [options]`` (same options as ``gymbridge smoke``)."""
    from gymbridge.cli import run_command

    parser = argparse.ArgumentParser(
        prog="gymbridge smoke", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_smoke_arguments(parser)
    args = parser.parse_args(argv)
    return run_command(args, prog="gymbridge smoke", log_level=args.log_level)


if __name__ == "__main__":
    sys.exit(main())
