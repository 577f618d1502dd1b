"""``RunConfig``: a GRPO run's settings, one section per component, every default defined once.

A run's config is the components' own configs side by side (``env``, ``data``, ``model``,
``generator``, ``rollout``, ``bridge``, ``shaping``, ``warmup``, ``trainer``, ``dp``,
``checkpoint``, ``eval``, ``output``) plus ``steps`` and ``seed``. The defaults are the config classes'
field defaults and nothing else: they are what a user fine-tuning a pretrained VLM expects
(``trainer.lr`` 1e-6, no shaping, no format warm-up; :class:`~gymbridge.trainer.GRPOConfig`).

**Overlays.** A YAML config states only what differs from what it overlays. It may start with
``defaults: [name, ...]``: shipped configs (``gymbridge/configs/<name>.yaml``) or files relative
to it, merged in order before its own keys (Hydra's composition, without Hydra). The shipped
``smoke`` overlay is the colour toy on the tiny random model; a test checks that every shipped
config resolves to exactly its overlay chain over the defaults, and that no overlay restates a
value it overlays.

**Loading** (:func:`load_run_config`): the overlays in order, then ``--set key=value`` dot-list
overrides, then the command line's flags (``--steps``, ``--env``, ...); OmegaConf interpolation
(``${steps}``) resolves after every merge; pydantic validates and every problem is reported at
once (:class:`~gymbridge.errors.ConfigError`). A key of the old flat launcher config
(``dedup``, ``max_staleness``, ...) is refused with its new dotted name.

**Switching environments.** ``--env``, ``--agent-url``, ``--head-url`` (or a ``--set`` of
``env.name`` / ``env.agent_url`` / ``env.head_url`` / ``env.mix``) naming another environment than
the overlays' drops the overlays' environment and what belongs to it (:data:`ENV_BOUND_KEYS`: its
generator parameters, token budget per model call, turns, format warm-up, forced first call), so
one environment's settings never leak into another's.

Invariants: ``trainer.lr_decay_steps`` left unset follows ``steps`` on every path (file, code,
command line); cross-section rules (``force_first_call`` needs native rollouts, a bf16 policy
needs a generator that holds bf16 weights, ...) are checked here, before anything starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from omegaconf import DictConfig, ListConfig, OmegaConf
from pydantic import Field, field_validator, model_validator

from gymbridge.bridge.config import BridgeConfig
from gymbridge.bridge.shaping import ShapingConfig
from gymbridge.config import StrictModel, merge_overrides, read_config, validate_config, validate_plain
from gymbridge.errors import ConfigError
from gymbridge.run.placement import GeneratorConfig
from gymbridge.run.reporters import ReportTo
from gymbridge.run.warmup import WarmupConfig
from gymbridge.trainer.grpo import GRPOConfig

__all__ = [
    "CONFIGS_DIR",
    "ENV_BOUND_KEYS",
    "FLAG_KEYS",
    "CheckpointConfig",
    "DPConfig",
    "DataConfig",
    "EnvConfig",
    "EnvMixEntry",
    "EvalConfig",
    "ModelConfig",
    "OutputConfig",
    "RolloutConfig",
    "RunConfig",
    "config_path",
    "load_run_config",
    "read_overlay",
    "saved_run_config",
]

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
"""The shipped overlays (``gymbridge/configs/*.yaml``, package data)."""


class EnvMixEntry(StrictModel):
    """One environment of ``env.mix``."""

    name: str = Field(min_length=1)
    """An example or registered environment, or ``module:Class`` (as ``env.name``)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Its data generator's parameters (``{}``: its own defaults)."""
    weight: float = Field(1.0, gt=0)
    """Its share of the generated rows: ``weight / (sum of the weights)``."""
    label: str | None = Field(None, min_length=1, pattern=r"^[^/]+$")
    """The name its rows' ``agent_ref`` carries, which routes them to it and names its metrics
    (``env/<label>/...``); ``None``: its name (``:`` and ``/`` written ``-``), then ``-2``, ``-3``, ...
    for a name that repeats."""


class EnvConfig(StrictModel):
    """The ``env:`` section: what the policy is trained on, one of ``name``, ``agent_url``,
    ``head_url`` or ``mix``."""

    name: str | None = None
    """An example or registered environment (``gymbridge env list``), or ``module:Class`` (your
    :class:`~gymbridge.server.ResourcesServer` subclass, started by the run beside our agent)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """The environment's data-generator parameters (``gymbridge env list --params``); ``{}``: its own
    defaults."""
    agent_url: str | None = None
    """A running NeMo Gym agent (``POST /run``; a genuine nemo-gym one included): the run starts no
    environment and no agent, only the model server that agent calls (``generator.port``)."""
    head_url: str | None = None
    """A running NeMo Gym head server: every row's ``agent_ref`` names the agent that runs it (found
    through the head's ``/global_config_dict_yaml``); as with ``agent_url`` the run starts only the
    model server those agents call (``generator.port``)."""
    mix: list[EnvMixEntry] = Field(default_factory=list)
    """Several of gymbridge's environments in one run, each started with an agent of its own; the
    generated rows interleave them by ``weight`` and carry ``agent_ref`` naming each row's
    environment (``[]``: one environment, ``name``)."""

    @model_validator(mode="after")
    def _one_source(self) -> EnvConfig:
        given = [k for k in ("name", "agent_url", "head_url") if getattr(self, k) is not None]
        problems = []
        if self.head_url is not None and len(given) > 1:
            others = ", ".join(f"env.{k}" for k in given if k != "head_url")
            problems.append(f"env.head_url with {others}: the head server's agents hold the environments")
        if self.mix:
            if given:
                problems.append(
                    f"env.mix with {', '.join(f'env.{k}' for k in given)}: a mix names its environments "
                    "itself (env.mix[i].name)"
                )
            if self.params:
                problems.append("env.params with env.mix: give each environment's as env.mix[i].params")
            labels = self.mix_labels
            twice = sorted({label for label in labels if labels.count(label) > 1})
            if twice:
                problems.append(f"env.mix: the labels {twice} name two environments; give each its own label")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def mix_labels(self) -> list[str]:
        """The label of each ``mix`` entry, in order (:attr:`EnvMixEntry.label`)."""
        seen: dict[str, int] = {}
        labels: list[str] = []
        for entry in self.mix:
            if entry.label is not None:
                labels.append(entry.label)
                continue
            base = entry.name.replace(":", "-").replace("/", "-")
            seen[base] = seen.get(base, 0) + 1
            labels.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
        return labels


class DataConfig(StrictModel):
    """The ``data:`` section."""

    path: str | None = None
    """NeMo Gym rows (jsonl) to train on, each validated in one streaming pass before anything
    starts; the run directory refers to the file (``dataset.ref.json``: its path, size, sha256 and
    row count; a resume refuses a file that changed) and the bridge reads it lazily. ``None``: rows
    made by the environment's data generator (``steps x bridge.prompts_per_step`` of them), written
    to the run directory's ``dataset.jsonl``."""
    copy_rows: bool = False
    """Copy ``path``'s rows into the run directory's ``dataset.jsonl`` (the run's sampling defaults
    filled in; base64 media included) instead of referring to the file: the run then survives the
    file moving or changing, at the cost of its size again on disk."""


class ModelConfig(StrictModel):
    """The ``model:`` section: the policy, and the generator's copy of it."""

    name: str = "tiny"
    """``tiny`` (the offline random-weight Qwen2-VL, ``tiny:qwen2_vl``, or the Qwen2.5-Omni thinker when
    the environment takes audio or video), ``tiny:FAMILY`` (a tiny model of one VLM family:
    qwen2_vl, qwen2_5_vl, qwen3_vl, gemma3, internvl, qwen2_5_omni; docs/models.md),
    ``tiny-qwen2-vl`` / ``tiny-qwen2.5-omni`` (aliases of ``tiny:qwen2_vl`` / ``tiny:qwen2_5_omni``),
    or a local Hugging Face model directory (never downloaded)."""
    seed: int = 0
    """Seed of the tiny model's random weights."""
    backend: Literal["hf", "vllm"] = "hf"
    """Generation backend of a model directory: ``vllm`` (GPU) serves it in a child process."""
    max_model_len: int = Field(4096, ge=16)
    """Longest prompt + generation, in tokens."""

    @field_validator("name")
    @classmethod
    def _tiny_or_a_directory(cls, value: str) -> str:
        from gymbridge.models.tiny_families import TINY_FAMILIES, TINY_PREFIX
        from gymbridge.run.model import TINY_MODELS, is_tiny_name, tiny_family_of

        if is_tiny_name(value):
            try:
                tiny_family_of(value)
            except ConfigError as e:
                raise ValueError("; ".join(e.problems)) from None
        elif not Path(value).is_dir():
            tiny = ", ".join((*TINY_MODELS, *(f"{TINY_PREFIX}{f}" for f in TINY_FAMILIES)))
            raise ValueError(f"{value!r} is neither a tiny model ({tiny}) nor a model directory")
        return value

    @property
    def is_tiny(self) -> bool:
        from gymbridge.run.model import is_tiny_name

        return is_tiny_name(self.name)


class RolloutConfig(StrictModel):
    """The ``rollout:`` section: how each rollout runs."""

    native: bool = False
    """Drive model and environment in this process (:func:`~gymbridge.rollout.run_episode`) instead of
    sending rows to an agent's ``POST /run``."""
    max_tokens: int = Field(256, ge=1)
    """Generation budget per model call (each row's ``max_output_tokens`` unless it sets one). It
    belongs to the environment (:data:`ENV_BOUND_KEYS`): a tool call of the tiny tokenizer is about
    30 tokens, where the colour toy's one-word answer is one."""
    max_turns: int | None = Field(None, ge=1)
    """Model calls per episode; ``None``: the environment's own (its data module's ``MAX_TURNS``)."""
    deadline_s: float = Field(600.0, gt=0)
    """Wall-clock bound of one rollout (every HTTP hop and model call inside it)."""
    reproducible: bool = True
    """Seed every rollout's sampling from the run's ``seed``: native reruns are bit-identical; on the
    Gym path each group draws the same samples (their order follows HTTP arrival)."""
    media_by_reference: bool = False
    """Gym path: each prompt's inline media are stored once and the G ``/run`` rows carry
    ``http://.../media/<key>`` references instead of base64 copies (docs/media.md)."""
    force_first_call: str | None = None
    """Native only: the text every rollout's first model call emits (tokenized, plus end of turn;
    scored, not sampled); every later call samples."""
    withhold_later_media: bool = False
    """Debug control, native only: the generator does not see media that arrive after the first model
    call (the stale-prompt control); the trained turns keep them."""


class DPConfig(StrictModel):
    """The ``dp:`` section: data parallelism over Ray actors (the ``ray`` extra)."""

    workers: int = Field(0, ge=0)
    """0: train in this process; N: N Ray actors in one torch.distributed group."""
    ray_num_cpus: int = Field(2, ge=1)
    """CPUs of the local Ray the run starts (not used with ``ray_address``)."""
    ray_address: str | None = None
    """Join this Ray cluster (``ray.init(address=...)``, e.g. ``auto``) instead of starting one."""
    strategy: Literal["replicate", "fsdp"] = "replicate"
    """``replicate``: every worker holds the whole policy and its AdamW, gradients all-reduced;
    ``fsdp``: FSDP2 shards parameters, gradients and optimizer state over the workers (about 1/N
    each, fp32 masters with bf16 compute under ``trainer.dtype=bfloat16``), every block gathered
    around its own forward and backward, the weights streamed to the driver in
    ``generator.bucket_mb`` buckets. ``replicate`` stays the better choice for a model that fits
    one worker with room to spare (the tiny ones): ``fsdp`` pays an all-gather per block per pass
    and per publication, which costs more than the memory it saves there."""
    cpu_offload: bool = False
    """With ``strategy: fsdp``: keep each worker's shards, gradients and optimizer state in CPU
    memory (``CPUOffloadPolicy``), moved to the accelerator around each block's use."""

    @model_validator(mode="after")
    def _offload_needs_fsdp(self) -> DPConfig:
        if self.cpu_offload and self.strategy != "fsdp":
            raise ValueError("dp.cpu_offload needs dp.strategy=fsdp (a replica is not sharded)")
        return self


class CheckpointConfig(StrictModel):
    """The ``checkpoint:`` section. A run always writes a checkpoint after its last step."""

    every: int = Field(50, ge=0)
    """Write a checkpoint every N steps (0: only the final one)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept; older ones are removed once a newer one is complete."""


class EvalConfig(StrictModel):
    """The ``eval:`` section: validation on held-out prompts while the policy trains (off by default).

    Each evaluation sends up to ``max_prompts`` prompts ``n`` times through the run's own rollout
    path (Gym or native) at the policy version just published, trains on none of it, and writes
    ``eval.jsonl`` (mean reward, pass@k, pass@1[avg-of-k], majority@k with ``answer_key``; per
    environment too) and ``eval/step_<n>.jsonl`` (its rollouts). :mod:`gymbridge.run.evaluation`
    says how it interleaves with training."""

    data: str | None = None
    """NeMo Gym rows (jsonl) to validate on; ``None``: ``max_prompts`` rows from the environment's
    data generator at seed ``seed + 1`` (a generator of a small discrete task can repeat training
    prompts: give held-out rows of your own for a real validation set)."""
    every: int = Field(0, ge=0)
    """Evaluate after every K-th step (0: never during the run)."""
    at_start: bool = False
    """Evaluate the starting policy (version 0, or a resumed run's checkpoint) before step 1."""
    at_end: bool | None = None
    """Evaluate the final policy after the last step; ``None``: when ``every`` > 0."""
    n: int = Field(4, ge=1)
    """Samples per prompt (the k of pass@k)."""
    temperature: float | None = Field(None, ge=0)
    """Sampling temperature of validation rollouts; ``None``: ``trainer.temperature``. 0: greedy."""
    max_prompts: int = Field(64, ge=1)
    """Prompts per evaluation: the first ``max_prompts`` rows of ``data`` (or generated)."""
    answer_key: str | None = None
    """The result field holding each rollout's extracted answer (majority@k, ``no_answer``); ``None``:
    majority@k is not computed."""

    @property
    def enabled(self) -> bool:
        return self.every > 0 or self.at_start or bool(self.at_end)

    @property
    def final(self) -> bool:
        """Whether the last step is evaluated."""
        return self.every > 0 if self.at_end is None else self.at_end


class OutputConfig(StrictModel):
    """The ``output:`` section: where the run writes and what it reports."""

    run_dir: str | None = None
    """The run directory (config, dataset, metrics, failures, checkpoints, charts, rollouts, viewer);
    default ``runs/<env>-<UTC timestamp>``."""
    chart_every: int = Field(5, ge=1)
    """Redraw ``charts/`` and the viewer every N steps (and at step 1 and the end); rollout files are
    written every step. A writer thread does it all, off the loop (``timing/artifacts``)."""
    artifacts: bool = True
    """Write ``rollouts/``, ``media/``, ``charts/`` and the viewer (``false``: ``metrics.jsonl``,
    checkpoints and the console only; ``benchmarks/step_overhead.py`` compares both)."""
    report_to: list[ReportTo] = Field(default_factory=list)
    """Also send each step's metrics record to ``wandb`` / ``tensorboard`` (optional extras)."""
    payload_metrics: bool = True
    """Measure the bytes crossing each boundary (``payload`` in ``metrics.jsonl``, the final table)."""
    export: Literal["final", "none"] = "final"
    """``final``: at the end, write ``RUN_DIR/export/`` from the final checkpoint, a Hugging Face model
    directory (``from_pretrained``, vLLM, ``--model DIR``; docs/export.md) in ``trainer.dtype``;
    ``none``: checkpoints only (``gymbridge export RUN_DIR --out DIR`` writes one later)."""
    export_merge: bool = False
    """With ``export: final`` on a LoRA run (``trainer.lora.rank`` > 0): ``RUN_DIR/export/`` is the model
    with the adapters merged into its base (as a full run's export) and the adapter goes in
    ``RUN_DIR/export/adapter/``; ``false``: ``RUN_DIR/export/`` is the peft adapter directory. A full
    fine-tuning run's export is the model either way."""

    @field_validator("run_dir")
    @classmethod
    def _run_dir_is_not_a_file(cls, value: str | None) -> str | None:
        if value is not None and Path(value).exists() and not Path(value).is_dir():
            raise ValueError(f"{value} is a file, not a folder: give a new or existing directory")
        return value


class RunConfig(StrictModel):
    """A GRPO run's settings (module docstring); ``gymbridge train`` and ``gymbridge.run.train`` take it."""

    steps: int = Field(100, ge=1)
    """GRPO steps (one batch, one optimizer update each)."""
    seed: int = 0
    """The dataset's seed, and the rollouts' sampling seed with ``rollout.reproducible``."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    bridge: BridgeConfig = Field(default_factory=BridgeConfig)
    shaping: ShapingConfig = Field(default_factory=ShapingConfig)
    """Toy dense shaping added to the environment's reward (opt-in: ``kind: token_rate``)."""
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    """Supervised format warm-up before GRPO (opt-in: ``steps > 0``; :mod:`gymbridge.run.warmup`)."""
    trainer: GRPOConfig = Field(default_factory=GRPOConfig)
    """``trainer.temperature`` and ``trainer.top_p`` are also the rollouts' sampling settings (every
    dataset row gets them; a row asking for others is refused)."""
    dp: DPConfig = Field(default_factory=DPConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Validation while training (opt-in: ``every``, ``at_start`` or ``at_end``)."""
    output: OutputConfig = Field(default_factory=OutputConfig)

    @model_validator(mode="before")
    @classmethod
    def _decay_follows_steps(cls, data: Any) -> Any:
        """``trainer.lr_decay_steps`` left unset is the run's ``steps`` (on every path)."""
        if not isinstance(data, Mapping):
            return data
        trainer = data.get("trainer", {})
        if isinstance(trainer, GRPOConfig):
            trainer = trainer.model_dump(exclude_unset=True)
        if isinstance(trainer, Mapping) and trainer.get("lr_decay_steps") is None:
            steps = data.get("steps", cls.model_fields["steps"].default)
            return {**data, "trainer": {**trainer, "lr_decay_steps": steps}}
        return data

    @model_validator(mode="after")
    def _sections_agree(self) -> RunConfig:
        problems: list[str] = []
        if (
            self.trainer.dtype != "float32"
            and self.generator.placement == "process"
            and self.model.backend == "hf"
        ):
            problems.append(
                f"trainer.dtype={self.trainer.dtype} with generator.placement=process and model.backend=hf: "
                "that model server builds its transformers model in float32 and the weight sync loads "
                "only tensors of the receiving model's dtype; use generator.placement=in_process (built "
                "in trainer.dtype) or model.backend=vllm (the engine casts what it receives)"
            )
        if self.env.agent_url is not None and self.warmup.steps > 0:
            problems.append(
                f"warmup.steps={self.warmup.steps} with env.agent_url: the format warm-up trains on an "
                "example environment's format_examples, and an agent of your own holds the environment; "
                "set warmup.steps=0"
            )
        if self.rollout.force_first_call is not None and not self.rollout.native:
            problems.append(
                "rollout.force_first_call needs rollout.native: true (it forces the native output)"
            )
        if self.rollout.withhold_later_media and not self.rollout.native:
            problems.append(
                "rollout.withhold_later_media needs rollout.native: true (it edits the native input)"
            )
        if self.env.agent_url is not None and self.rollout.native:
            problems.append(
                "env.agent_url: native rollouts drive the environment themselves; drop rollout.native "
                "or env.agent_url"
            )
        if self.env.agent_url is not None and self.data.path is None:
            problems.append("env.agent_url: give data.path (the NeMo Gym rows the agent runs)")
        if self.env.head_url is not None:
            if self.data.path is None:
                problems.append(
                    "env.head_url: give data.path (NeMo Gym rows, each with the agent_ref of its agent)"
                )
            if self.rollout.native:
                problems.append(
                    "env.head_url: native rollouts drive the environment themselves; drop rollout.native "
                    "or env.head_url"
                )
            if self.warmup.steps > 0:
                problems.append(
                    f"warmup.steps={self.warmup.steps} with env.head_url: the format warm-up trains on an "
                    "example environment's format_examples, and the head server's agents hold the "
                    "environments; set warmup.steps=0"
                )
        if self.env.mix and self.warmup.steps > 0:
            problems.append(
                f"warmup.steps={self.warmup.steps} with env.mix: the format warm-up trains on one "
                "environment's format_examples; set warmup.steps=0"
            )
        if self.model.backend == "vllm":
            if self.model.is_tiny:
                problems.append(
                    "model.backend=vllm serves a model directory: give model.name=PATH (the tiny models "
                    "are hf only)"
                )
            if self.generator.placement != "process":
                problems.append(
                    "model.backend=vllm runs the model server as its own process: set "
                    "generator.placement=process"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def env_label(self) -> str:
        """What the run trains on, for file names and messages: the env's name, ``mix`` (``env.mix``),
        ``head`` (``env.head_url``) or ``agent``."""
        if self.env.mix:
            return "mix"
        if self.env.head_url is not None:
            return "head"
        if self.env.agent_url is not None or self.env.name is None:
            return "agent"
        return self.env.name.replace(":", "-").replace("/", "-")


FLAG_KEYS: dict[str, str] = {
    "steps": "steps",
    "seed": "seed",
    "env": "env.name",
    "agent_url": "env.agent_url",
    "head_url": "env.head_url",
    "dataset": "data.path",
    "model": "model.name",
    "backend": "model.backend",
    "model_port": "generator.port",
    "native": "rollout.native",
    "prompts_per_step": "bridge.prompts_per_step",
    "group_size": "bridge.group_size",
    "dp_workers": "dp.workers",
    "run_dir": "output.run_dir",
}
"""Command-line flag (``argparse`` dest) -> the config key it sets."""

ENV_BOUND_KEYS: tuple[str, ...] = (
    "env.params",
    "rollout.max_tokens",
    "rollout.max_turns",
    "rollout.force_first_call",
    "rollout.withhold_later_media",
    "warmup",
)
"""Keys that belong to one environment: dropped when the command line switches to another."""

_MOVED: dict[str, str] = {
    "env_params": "env.params",
    "agent_url": "env.agent_url",
    "dataset": "data.path",
    "model_seed": "model.seed",
    "backend": "model.backend",
    "max_model_len": "model.max_model_len",
    "model_port": "generator.port",
    "native": "rollout.native",
    "max_tokens": "rollout.max_tokens",
    "max_turns": "rollout.max_turns",
    "rollout_deadline_s": "rollout.deadline_s",
    "reproducible": "rollout.reproducible",
    "media_by_reference": "rollout.media_by_reference",
    "force_first_call": "rollout.force_first_call",
    "withhold_later_media": "rollout.withhold_later_media",
    "prompts_per_step": "bridge.prompts_per_step",
    "group_size": "bridge.group_size",
    "min_group_size": "bridge.min_group_size",
    "max_consecutive_failed_groups": "bridge.max_consecutive_failed_groups",
    "dedup": "bridge.dedup",
    "advantage": "bridge.advantage",
    "reward_components_check": "bridge.reward_components_check",
    "dynamic_sampling": "bridge.dynamic_sampling",
    "dynamic_sampling_max_rounds": "bridge.dynamic_sampling_max_rounds",
    "dp_workers": "dp.workers",
    "ray_num_cpus": "dp.ray_num_cpus",
    "ray_address": "dp.ray_address",
    "checkpoint_every": "checkpoint.every",
    "run_dir": "output.run_dir",
    "work_dir": "output.run_dir",
    "chart_every": "output.chart_every",
    "report_to": "output.report_to",
    "payload_metrics": "output.payload_metrics",
}
"""Keys of the old flat launcher config -> their section (for the error that names the new key)."""


def config_path(name: str | Path) -> Path:
    """A ``--config`` argument as a file: a path, or the name of a shipped overlay (``smoke_ray``)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = CONFIGS_DIR / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if path.parent in (Path("."), Path("configs")) and shipped.is_file():
        return shipped
    return path  # read_config names the file it cannot read


def read_overlay(name: str | Path, *, _seen: tuple[Path, ...] = ()) -> DictConfig:
    """An overlay with its ``defaults:`` chain merged in (unresolved; interpolations stay as written)."""
    path = config_path(name).resolve()
    if path in _seen:
        chain = " -> ".join(p.name for p in (*_seen, path))
        raise ConfigError([f"defaults: a cycle ({chain})"], source=str(path))
    conf = read_config(path)
    parents = conf.pop("defaults", None)
    if parents is None:
        return conf
    names = [parents] if isinstance(parents, str) else list(parents)
    merged: DictConfig = OmegaConf.create({})
    for parent in names:
        if not isinstance(parent, str):
            raise ConfigError(
                [f"defaults: entries are config names or paths, got {parent!r}"], source=str(path)
            )
        sibling = path.parent / (parent if parent.endswith(".yaml") else f"{parent}.yaml")
        merged = OmegaConf.merge(
            merged, read_overlay(sibling if sibling.is_file() else parent, _seen=(*_seen, path))
        )  # type: ignore[assignment]
    return OmegaConf.merge(merged, conf)  # type: ignore[return-value]


_ENV_SOURCE_KEYS = ("env.name", "env.agent_url", "env.head_url", "env.mix")
"""What a run trains on (one of them): the keys the command line replaces when it names another."""


def _env_of(conf: DictConfig) -> str | None:
    value = OmegaConf.select(conf, "env.name", default=None)
    return None if value is None else str(value)


def _env_source(conf: DictConfig) -> dict[str, Any]:
    """The environment keys of ``conf`` that are set (:data:`_ENV_SOURCE_KEYS`), as written."""
    found: dict[str, Any] = {}
    for key in _ENV_SOURCE_KEYS:
        node = OmegaConf.select(conf, key, default=None, throw_on_resolution_failure=False)
        if isinstance(node, (DictConfig, ListConfig)):
            node = OmegaConf.to_container(node, resolve=False)
        if node not in (None, []):
            found[key] = node
    return found


def _drop(conf: DictConfig, dotted: str) -> None:
    *parents, last = dotted.split(".")
    node: Any = conf
    for part in parents:
        node = node.get(part) if isinstance(node, DictConfig) else None
        if node is None:
            return
    if isinstance(node, DictConfig) and last in node:
        node.pop(last)


def load_run_config(
    configs: Sequence[str | Path] = (),
    overrides: Sequence[str | tuple[str, Any]] = (),
    flags: Mapping[str, Any] | None = None,
) -> RunConfig:
    """The run's config: ``configs`` (overlays, in order), ``overrides`` (``--set``), then ``flags``.

    ``flags`` are the command line's named options (:data:`FLAG_KEYS`; ``None`` values are not
    given). See the module docstring for the order, the environment switch and the errors.
    """
    where = ", ".join(str(c) for c in configs) or None
    conf: DictConfig = OmegaConf.create({})
    for name in configs:
        conf = OmegaConf.merge(conf, read_overlay(name))  # type: ignore[assignment]
    given = {FLAG_KEYS[k]: v for k, v in (flags or {}).items() if v is not None}
    unknown = sorted(set(flags or {}) - set(FLAG_KEYS))
    if unknown:
        raise ValueError(f"not run flags: {unknown}")
    overlay_env = _env_of(conf)
    new_env = given.get("env.name")
    overlay_source = _env_source(conf)
    named = merge_overrides(merge_overrides(conf, overrides, where=where), list(given.items()), where=where)
    switched = (new_env is not None and new_env != overlay_env) or (
        bool(overlay_source) and _env_source(named) != overlay_source
    )
    if switched:  # the overlays' environment, and what belongs to it, gives way to the one named
        for key in (*ENV_BOUND_KEYS, *_ENV_SOURCE_KEYS):
            _drop(conf, key)
    conf = merge_overrides(conf, overrides, where=where)
    conf = merge_overrides(conf, list(given.items()), where=where)
    _refuse_moved_keys(conf, where)
    return validate_config(conf, RunConfig, where=where)


def _refuse_moved_keys(conf: DictConfig | Mapping[str, Any], where: str | None) -> None:
    old = [str(k) for k in conf if str(k) in _MOVED]
    if old:
        raise ConfigError(
            [f"{k}: the run config is sectioned now; this key is {_MOVED[k]}" for k in old], source=where
        )


def saved_run_config(data: Mapping[str, Any], *, where: str) -> RunConfig:
    """A run directory's saved ``config.yaml`` (resolved: no interpolation) as a :class:`RunConfig`."""
    _refuse_moved_keys(data, where)
    return validate_plain(dict(data), RunConfig, where=where)
