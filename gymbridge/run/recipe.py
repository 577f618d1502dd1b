"""``GRPORun``: a GRPO run as a recipe, ``setup()``, ``step()``, ``train()``, ``cleanup()``.

::

    async with GRPORun(config) as run:      # setup(): everything below, in this order
        await run.train()                   # step() until config.steps (or the data runs out)

:meth:`GRPORun.setup` reads top to bottom in phases:

1. **run directory** (:mod:`gymbridge.run.rundir`): a fresh run refuses a directory that holds
   one; ``resume="must"`` (``--resume``) needs a checkpoint and refuses without one
   (:class:`~gymbridge.errors.ResumeError`); ``resume="allow"`` (``--resume-or-start``) starts
   afresh when there is none, setting the earlier attempt's lines aside. A run whose checkpoint
   already holds every step does nothing and says so. No history line is ever lost (a resume
   moves the lines after its checkpoint to ``*.rewound.jsonl``);
2. **data** (:mod:`gymbridge.run.data`): ``dataset.ref.json`` (``data.path`` by reference, read
   lazily; a resume checks its size and sha256) or ``dataset.jsonl`` (generated rows, or
   ``data.copy_rows``), written once;
3. **model** (:mod:`gymbridge.run.model`) and **trainer**: a resumed run loads its checkpoint
   (weights, optimizer, RNG, the rows done); a fresh one runs the optional format warm-up
   (:mod:`gymbridge.run.warmup`), then takes the KL reference from the warmed-up weights. The
   reference is held in the trainer's dtype on every path (fresh, resumed, DP workers);
4. **services** (:mod:`gymbridge.run.services`): environment, media server, generator
   (in process or its own process), agent; version 0 of the weights is published;
5. **data parallelism** (``dp.workers > 0``: :class:`~gymbridge.trainer.RayDPTrainer`);
6. **bridge** (:class:`~gymbridge.bridge.BridgeIterator` with the run's
   :class:`~gymbridge.bridge.BridgeConfig`), skipping a resumed run's done rows.

:meth:`GRPORun.step` asks the bridge for a batch at the trainer's policy version (with
``bridge.max_staleness = k > 0`` the next ``k`` batches' rollouts keep running meanwhile), runs
the update in a worker thread (the event loop, the servers and in-flight rollouts keep going),
publishes the new weights when the optimizer stepped, hands a
:class:`~gymbridge.run.report.StepReport` to every callback and writes a checkpoint every
``checkpoint.every`` steps. Each report's ``timing`` splits the step's wall seconds into phases
(:mod:`gymbridge.run.timing`: waiting for rollouts, generation, environment, the bridge's own
work, the update, the publication, the previous step's reporting and checkpoint, ``other``);
the end summary prints their medians. A batch that cannot train (no loss token, or zero advantage on every
row without a KL term) does not step the optimizer, keeps the policy version and publishes
nothing; its record says ``skipped``.

Invariants: the run's last step always gets a checkpoint; a step's ``metrics.jsonl`` line is on
disk before its checkpoint; every server, child process and Ray worker the run started is
stopped by :meth:`cleanup` whatever happened; nothing listens outside 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

from gymbridge.errors import ConfigError, ResumeError
from gymbridge.rowset import RowSet
from gymbridge.run.callbacks import Callback, default_callbacks
from gymbridge.run.config import RunConfig
from gymbridge.run.report import RunSummary, StepReport, group_rewards, payload_delta
from gymbridge.run.rundir import RunDir, default_run_dir
from gymbridge.run.timing import StepCounters, generator_keys, median_split, split_step

if TYPE_CHECKING:
    from types import TracebackType

    from gymbridge.bridge import BridgeIterator, TokenRateShaping
    from gymbridge.metrics import PayloadMeter
    from gymbridge.run.evaluation import EvalPass, Validation
    from gymbridge.run.model import RunModel
    from gymbridge.run.services import Services
    from gymbridge.tensors import TrainBatch
    from gymbridge.trainer import GRPOTrainer, StepMetrics

__all__ = ["GRPORun", "ResumeMode", "episode_turns", "resolve_run_env", "spec_modalities", "train"]

ResumeMode = Literal["never", "must", "allow"]
"""``never``: a fresh run; ``must``: continue from the newest checkpoint or refuse; ``allow``: continue
when there is a checkpoint, else start afresh in the same directory."""

_TRANSPORT_NAMES = {"broadcast": "torch.distributed broadcast", "shared_memory": "shared memory"}
"""The placement line's words for each ``DistributedPublisher.transport``."""


class GRPORun:
    """One GRPO run (module docstring). Use it as an async context manager, or call :meth:`setup`
    and :meth:`cleanup` yourself."""

    def __init__(
        self,
        config: RunConfig,
        *,
        callbacks: Sequence[Callback] | None = None,
        resume: ResumeMode = "never",
        out: IO[str] | None = None,
        progress: bool = False,
    ) -> None:
        """``callbacks`` (default: :func:`~gymbridge.run.callbacks.default_callbacks`) get every report."""
        self.config = config
        self.callbacks = (
            list(callbacks)
            if callbacks is not None
            else default_callbacks(out=out, progress=progress, artifacts=config.output.artifacts)
        )
        self.resume = resume
        self.summary = RunSummary()
        self.version = 0
        """The trainer's policy version: optimizer steps so far (a resumed run's included)."""
        self.first_step = 1
        self.next_step = 1
        self._stack = contextlib.AsyncExitStack()
        self._started = 0.0
        self._set_up = False
        self._done_task_indices = RowSet()
        self._resuming = False
        self._resumed_shards: Path | None = None
        """A sharded checkpoint this run resumed from, whose slices the FSDP workers load."""
        self._checkpointed = 0
        self._trainer_keys: dict[str, Any] = {}
        """The trainer's fixed facts every ``metrics.jsonl`` record carries (``lora_rank``, ...)."""
        # set by setup()
        self.run_dir: RunDir
        self.model: RunModel
        self.trainer: GRPOTrainer
        self.bridge: BridgeIterator
        self.services: Services
        self.meter: PayloadMeter
        self.shaping: TokenRateShaping | None = None
        self.dp: Any = None
        self._update: Callable[[TrainBatch], StepMetrics]
        self._publish: Callable[[int], float] | None = None
        """Hands the trainer's weights to the generator as a version (``None``: publication off)."""
        self._model_url: str | None = None
        self.counters = StepCounters()
        """The model server's and the agent's counters (:mod:`gymbridge.run.timing`; none from parts)."""
        self._window: float | None = None
        """When the current step's wall time began: the moment the previous step's record was made."""
        self._tail = {"artifacts": 0.0, "checkpoint": 0.0}
        """The previous step's reporting and checkpoint seconds (counted in the next step's split)."""
        self.env_spec: Any = None
        """What the run trains on (:meth:`_resolve_env`): an environment's spec, an
        :class:`~gymbridge.run.userenv.EnvMix`, or ``None`` (agents of the user's own)."""
        self.validation: Validation | None = None
        """The run's validation (``eval:``; :mod:`gymbridge.run.evaluation`), ``None`` when off."""

    @classmethod
    def from_parts(
        cls,
        config: RunConfig,
        *,
        run_dir: RunDir,
        model: RunModel,
        trainer: GRPOTrainer,
        bridge: BridgeIterator,
        update: Callable[[TrainBatch], StepMetrics] | None = None,
        publish: Callable[[int], float] | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> GRPORun:
        """A run over parts built elsewhere, ready to :meth:`step` (no servers, no warm-up, no data file).

        ``update`` defaults to ``trainer.step``; ``publish(version)`` hands the weights on (``None``:
        nothing to publish to). For tests of the loop and for embedding the loop in another program;
        :meth:`cleanup` closes the bridge and the callbacks.
        """
        from gymbridge.metrics import PayloadMeter

        run = cls(config, callbacks=callbacks)
        run.run_dir, run.model, run.trainer, run.bridge = run_dir, model, trainer, bridge
        run.meter = PayloadMeter(enabled=False) if bridge.meter is None else bridge.meter
        run._update = update if update is not None else trainer.step
        run._publish = publish
        run.summary.run_dir = str(run_dir.path)
        run._started = time.perf_counter()
        run._stack.callback(run._close_callbacks)
        run._stack.push_async_callback(bridge.aclose)
        for cb in run.callbacks:
            cb.on_setup(run)
        run._set_up = True
        return run

    # ------------------------------------------------------------------ messages
    def say(self, text: str) -> None:
        """Hand a line to every callback (the console prints it)."""
        for cb in self.callbacks:
            cb.on_message(text)

    # ------------------------------------------------------------------ setup
    async def __aenter__(self) -> GRPORun:
        try:
            await self.setup()
        except BaseException:  # what setup started so far is stopped before the error goes on
            await self.cleanup()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.cleanup()

    async def setup(self) -> None:
        """Phases 1-6 of the module docstring; afterwards :meth:`step` can run."""
        self._started = time.perf_counter()
        self._stack.callback(self._close_callbacks)  # the first registered: closed last
        self._setup_run_dir()
        if self.summary.nothing_to_do:
            return
        spec = self._resolve_env()
        self._setup_data(spec)
        self._setup_model(spec)
        await self._setup_trainer(spec)
        await self._setup_services(spec)
        self._setup_dp()
        self._setup_bridge()
        self._setup_eval(spec)
        self.env_spec = spec
        for cb in self.callbacks:
            cb.on_setup(self)
        self._set_up = True
        self._eval_at_setup()

    def _setup_run_dir(self) -> None:
        from gymbridge.trainer.checkpoint import latest_step

        cfg = self.config
        path = default_run_dir(cfg.env_label) if cfg.output.run_dir is None else Path(cfg.output.run_dir)
        self.say(f"run dir: {path}")
        run = RunDir(path)
        done = latest_step(run.checkpoints_path)
        if self.resume == "never":
            if run.has_metrics() or done is not None:
                raise ConfigError(
                    [
                        f"output.run_dir {path} already holds a run: continue it with --resume {path}, "
                        "or pick another run directory"
                    ]
                )
        elif done is None and self.resume == "must":
            raise ResumeError(
                path,
                f"no checkpoint in {run.checkpoints_path}: the run stopped before its first one "
                f"(checkpoint.every={cfg.checkpoint.every}), so there is nothing to continue from. Start it "
                f"again in the same directory with --resume-or-start {path} (its earlier metrics and "
                "failures "
                "are kept in *.rewound.jsonl), or give a new --run-dir",
            )
        elif done is not None and done >= cfg.steps:
            self.summary = RunSummary(run_dir=str(path), nothing_to_do=True, resumed_from_step=done)
            self.say(f"nothing left to run: the checkpoint holds all {cfg.steps} step(s) of {path}")
            return
        self.run_dir = RunDir.create(path)
        self.summary.run_dir = str(path)
        self.config = cfg = cfg.model_copy(
            update={"output": cfg.output.model_copy(update={"run_dir": str(path)})}
        )
        self._resuming = done is not None
        if not self._resuming:
            moved = self.run_dir.set_aside()
            if moved:
                self.say(
                    f"no checkpoint in {path}: starting afresh ({moved} earlier lines in *.rewound.jsonl)"
                )
            self.run_dir.write_config(cfg.model_dump(mode="json"))

    def _resolve_env(self) -> Any:
        """The environment's spec (:func:`resolve_run_env`)."""
        return resolve_run_env(self.config)

    def _setup_data(self, spec: Any) -> None:
        from gymbridge.run.data import resume_dataset, write_run_dataset
        from gymbridge.run.userenv import EnvMix, UserEnv

        cfg = self.config
        kept = resume_dataset(self.run_dir, progress=self.say) if self._resuming else None
        if kept is not None:  # a reference is re-checked: ResumeError if the file changed
            self.say(kept)
            return
        if cfg.data.path is None and isinstance(spec, EnvMix) and not spec.has_generator:
            without = [f"{e.label} ({e.spec.name})" for e in spec.envs if not e.has_generator]
            raise ConfigError(
                [
                    f"env.mix: {', '.join(without)} has no data generator; give data.path (NeMo Gym rows, "
                    "each with the agent_ref of its environment: --dataset)"
                ]
            )
        if cfg.data.path is None and (spec is None or isinstance(spec, UserEnv)):
            where = cfg.env.agent_url or cfg.env.head_url or cfg.env.name
            raise ConfigError([f"{where}: no data generator here; give data.path (NeMo Gym rows: --dataset)"])
        self.say(write_run_dataset(cfg, spec, self.run_dir, progress=self.say))

    def _setup_model(self, spec: Any) -> None:
        from gymbridge.bridge import TokenRateShaping
        from gymbridge.metrics import PayloadMeter
        from gymbridge.run.model import pick_model, require_vllm

        cfg = self.config
        if cfg.model.backend == "vllm":
            require_vllm()
        self.model = pick_model(cfg.model.name, cfg.model.seed, spec_modalities(spec), cfg.model.backend)
        origin = "random weights, offline" if self.model.tiny else "local directory"
        self.say(f"model: {self.model.name} ({origin})")
        _check_suppressed(cfg.trainer.suppress_token_ids, self.model.policy.config)
        t = cfg.trainer
        schedule = "constant" if not t.lr_scheduled else f"{t.lr_schedule}, warm-up {t.lr_warmup_steps}"
        self.say(
            f"trainer: lr {t.lr:g} ({schedule}), adam_eps {t.adam_eps:g}, G={cfg.bridge.group_size} x "
            f"{cfg.bridge.prompts_per_step} prompts, kl_coef {t.kl_coef:g}, {t.dtype}; warm-up "
            f"{cfg.warmup.steps} step(s); shaping {cfg.shaping.kind} (config.yaml has every setting)"
        )
        self.meter = PayloadMeter(enabled=cfg.output.payload_metrics)
        self.shaping = TokenRateShaping.from_config(cfg.shaping, self.model.tokenizer)
        if self.shaping is not None:
            self.say(
                f"shaping: toy dense reward added to the env reward: {self.shaping.weight:g} x fraction of "
                f"generated tokens made of {self.shaping.chars!r} ({len(self.shaping.token_ids)} token ids)"
            )

    async def _setup_trainer(self, spec: Any) -> None:
        from gymbridge.trainer import GRPOTrainer
        from gymbridge.trainer.checkpoint import load_checkpoint
        from gymbridge.trainer.memory import prepare_policy

        cfg = self.config
        policy = self.model.policy
        if cfg.trainer.lora.enabled:  # before anything collects the policy's parameters
            from gymbridge.generation.lora import apply_lora

            try:
                lora = apply_lora(policy, cfg.trainer.lora, init_seed=cfg.seed)
            except ValueError as exc:
                raise ConfigError([str(exc)]) from exc
            self.say(
                f"{lora.describe()}; vision tower {cfg.trainer.lora.vision}; "
                "only these publish and checkpoint"
            )
        # fp32 master weights on every path: bf16 autocast here and on replicated DP workers, FSDP's
        # mixed precision on sharded ones; the generator and the KL reference get the trainer's dtype
        try:  # frozen encoders, checkpointed blocks: before the trainer collects its parameters
            memory = prepare_policy(policy, cfg.trainer, masters=True)
        except ValueError as exc:
            raise ConfigError([str(exc)]) from exc
        self.say(memory.describe())
        # the drift guard (ratio 1 before the update) holds only on-policy; running ahead it is reported
        self.trainer = GRPOTrainer(policy, cfg.trainer, on_policy=cfg.bridge.max_staleness == 0)
        self._trainer_keys = {
            "lora_rank": cfg.trainer.lora.rank,
            "trainable_params": memory.trainable_params,
        }
        if self.trainer.kl_reference == "base_adapters_off":
            self.say("KL reference: the base model with the adapters off (no reference copy)")
        if self._resuming:
            fsdp = bool(cfg.dp.workers) and cfg.dp.strategy == "fsdp"
            # fsdp: the workers load their slices of a sharded checkpoint's optimizer state, not the driver
            state = load_checkpoint(self.run_dir.checkpoints_path, trainer=self.trainer, optimizer=not fsdp)
            assert state is not None  # latest_step() found it
            self._resumed_shards = state.path if state.sharded and fsdp else None
            moved = self.run_dir.rewind(last_step=state.step, done_task_indices=state.done_task_indices)
            self.version = state.policy_version
            self.first_step = self.next_step = state.step + 1
            self.summary.resumed_from_step = state.step
            self._done_task_indices = state.done_task_indices
            self.say(
                f"resumed: step {state.step}/{cfg.steps}, policy version {state.policy_version}, "
                f"{len(state.done_task_indices)} row(s) done ({state.path.name})"
                + (f"; {moved} later line(s) set aside in *.rewound.jsonl" if moved else "")
            )
            return
        if spec is not None and cfg.warmup.steps > 0:
            await self._warmup(spec)
        if self.trainer.reference is not None:  # KL to the policy RL starts from: the warmed-up one
            self.trainer.freeze_reference()  # held in the trainer's dtype whatever the policy's
        if cfg.trainer.dtype != "float32":
            name = cfg.trainer.dtype
            compute = "FSDP mixed precision" if cfg.dp.workers and cfg.dp.strategy == "fsdp" else "autocast"
            held = f"fp32 master weights and AdamW state, {name} {compute}"
            self.say(f"policy dtype: {name} (trainer: {held}; reference and generator: {name})")

    async def _warmup(self, spec: Any) -> None:
        from gymbridge.generation.hf import HFGenerator
        from gymbridge.run.warmup import warmup_for_env

        cfg = self.config
        # trains the trainer's policy (rendered as the generator renders); v0 publication copies it over
        renderer = HFGenerator(self.model.policy, self.model.processor, max_model_len=cfg.model.max_model_len)
        warm = await asyncio.to_thread(
            warmup_for_env,
            spec,
            cfg.env.params,
            self.model.policy,
            renderer,
            cfg.warmup,
            forced_first_call=cfg.rollout.force_first_call,
        )
        if warm is not None and warm.examples == 0:
            self.say(
                f"format warm-up: nothing to train, its {warm.skipped} target(s) are all the forced "
                "first call (never sampled)"
            )
        elif warm is not None:
            self.say(
                f"format warm-up: {warm.steps} supervised steps, {warm.examples} image-independent targets"
                + (f" ({warm.skipped} of the forced first call left out)" if warm.skipped else "")
                + f", loss {warm.first_loss:.3f} -> {warm.last_loss:.3f} ({warm.elapsed_s:.1f}s)"
            )

    async def _setup_services(self, spec: Any) -> None:
        from gymbridge.run.services import start_services

        cfg = self.config
        self.services = await start_services(
            cfg,
            self._stack,
            model=self.model,
            spec=spec,
            max_turns=episode_turns(cfg, spec),
            run_path=self.run_dir.path,
            meter=self.meter,
        )
        self.summary.urls = dict(self.services.urls)
        handle = self.services.generator
        self.counters = self.services.step_counters()
        self._stack.push_async_callback(self.counters.aclose)
        self.summary.model_server_pid = handle.pid
        self._model_url = handle.model_url
        if handle.publisher is not None:
            self._publish = functools.partial(handle.publish, self.model.policy)
        for note in self.services.notes:
            self.say(note)
        self.say("servers: " + ", ".join(f"{k} {v}" for k, v in self.services.urls.items()))
        # version 0: the initial weights (a resumed run: its checkpoint's weights and version)
        sync_s = await asyncio.to_thread(handle.publish, self.model.policy, self.version)
        where = "in this process" if handle.placement == "in_process" else f"process {handle.pid}"
        if handle.fleet is not None:  # generator.replicas > 1: N processes behind the run's router
            pids = ", ".join(str(p) for p in handle.fleet.pids)
            where = f"fleet of {handle.fleet.size} model servers (processes {pids}) behind {handle.model_url}"
        if handle.publisher is None:
            self.say(f"generator: {where}; weight publication OFF (the generator keeps the step-0 weights)")
        else:
            transport = str(getattr(handle.publisher, "transport", None))  # set by the v0 publication
            how = "copy" if handle.placement == "in_process" else _TRANSPORT_NAMES.get(transport, transport)
            self.say(
                f"generator: {where}; weights published after every step ({how}); "
                f"v{self.version} in {sync_s:.3f}s"
            )

    def _setup_dp(self) -> None:
        cfg = self.config
        self._update = self.trainer.step
        if cfg.dp.workers == 0:
            return
        from gymbridge.trainer.models import from_config
        from gymbridge.trainer.ray_dp import RayDPTrainer, init_ray, require_ray

        strategy = cfg.dp.strategy

        try:
            ray = require_ray()
        except ImportError as exc:
            raise ConfigError([f"dp.workers={cfg.dp.workers}: {exc}"]) from exc
        if not ray.is_initialized():
            init_ray(cfg.dp.ray_num_cpus, address=cfg.dp.ray_address)
            self._stack.callback(ray.shutdown)  # ours: stopped after the workers (LIFO)
        policy = self.model.policy
        self.dp = RayDPTrainer(
            self.trainer,
            functools.partial(from_config, type(policy), policy.config),
            cfg.dp.workers,
            meter=self.meter,
            strategy=strategy,
            cpu_offload=cfg.dp.cpu_offload,
            bucket_bytes=cfg.generator.bucket_mb << 20,
        )
        self._stack.callback(self.dp.shutdown)
        if self._resumed_shards is not None:  # seeded with the driver's weights; now the saved slices
            self.dp.load_sharded_checkpoint(self._resumed_shards)
        if strategy == "fsdp" and self.trainer.reference is not None:
            self.trainer.reference = None  # the workers hold it, sharded; their checkpoints save it
        self._update = self.dp.step
        how = (
            "gradients all-reduced in the group, rank 0's weights published"
            if strategy == "replicate"
            else "parameters, gradients, optimizer state and KL reference sharded (FSDP2), weights "
            f"streamed from the shards in {cfg.generator.bucket_mb} MiB buckets"
            + (", CPU offload" if cfg.dp.cpu_offload else "")
        )
        self.say(
            f"data parallel ({strategy}): {cfg.dp.workers} Ray worker(s) in one torch.distributed group "
            f"({self.dp.backend}, {self.dp.num_gpus:g} GPU each); {how}"
        )

    def _setup_bridge(self) -> None:
        from gymbridge.bridge import BridgeIterator
        from gymbridge.media import MediaPolicy
        from gymbridge.tensors import MediaProcessor

        cfg = self.config
        hosts = self.services.media_hosts
        bridge_cfg = cfg.bridge
        if cfg.bridge.max_staleness == 0 and cfg.trainer.ratio_tolerance is not None:
            # on-policy with the drift guard on, a lagging generator must fail the step loudly
            bridge_cfg = bridge_cfg.model_copy(update={"drop_stale": False})
        self.bridge = BridgeIterator(
            self.run_dir.dataset_rows(cfg),
            self.services.source,
            MediaProcessor(self.model.processor),
            bridge_cfg,
            failures_path=self.run_dir.failures_path,
            meter=self.meter,
            media_policy=MediaPolicy(media_hosts=hosts) if hosts else None,
            placeholder_token_ids=list(self.model.placeholder_token_ids),
            reward_fn=self.shaping,
            skip_task_indices=self._done_task_indices,
        )
        self._stack.push_async_callback(self.bridge.aclose)

    def _setup_eval(self, spec: Any) -> None:
        """Validation (``eval:``): its prompts, over the rollout path the bridge uses."""
        from gymbridge.bridge.sources import unmetered
        from gymbridge.run.evaluation import Validation, eval_rows

        cfg = self.config
        if not cfg.eval.enabled:
            return
        rows = eval_rows(cfg, spec)
        self.validation = Validation(
            cfg,
            rows,
            unmetered(self.services.source),  # validation's requests stay out of the payload table
            self.run_dir,
            default_env=cfg.env_label,
        )
        self._stack.push_async_callback(self.validation.cancel)  # popped before the services stop
        e = cfg.eval
        where = e.data if e.data is not None else f"generated at seed {cfg.seed + 1}"
        plan = ", ".join(
            text
            for on, text in (
                (e.at_start, "at start"),
                (e.every > 0, f"every {e.every} step(s)"),
                (e.final, "at the end"),
            )
            if on
        )
        self.say(
            f"validation: {len(rows)} prompt(s) x {e.n} ({where}), temperature "
            f"{self.validation.temperature:g}, {plan}; -> {self.run_dir.eval_path}"
        )

    def _eval_at_setup(self) -> None:
        """Start the pass before step 1 (``eval.at_start``), or the one a resumed run's checkpoint
        step was due and ``eval.jsonl`` does not hold (the run stopped before it was written)."""
        if self.validation is None:
            return
        done = self.first_step - 1
        recorded = {r.get("step") for r in self.run_dir.iter_eval()}
        if self.validation is not None:
            self.validation.evaluated_steps.update(s for s in recorded if isinstance(s, int))
        if done == 0 and self.config.eval.at_start and 0 not in recorded:
            self.validation.start(step=0, version=self.version, when="start")
        elif done > 0 and self.validation.due(done):
            self.say(f"validation: the pass after step {done} is not in eval.jsonl; running it now")
            self.validation.start(step=done, version=self.version, when="every")

    async def _settle_eval(self) -> float:
        """Wait for the running validation pass, report it; returns the seconds waited."""
        if self.validation is None or not self.validation.running:
            return 0.0
        waited = await self.validation.settle()
        done = self.validation.last
        assert done is not None
        await asyncio.to_thread(self._report_eval, done)
        return waited

    def _report_eval(self, done: EvalPass) -> None:
        from gymbridge.run.evaluation import describe_pass

        self.say(describe_pass(done.record))
        for cb in self.callbacks:
            cb.on_eval(done.record, done.rollouts)

    # ------------------------------------------------------------------ the loop
    async def step(self) -> StepReport | None:
        """One step (module docstring); ``None`` when the data ran out."""
        if not self._set_up:
            raise RuntimeError("GRPORun.step() before setup()")
        cfg = self.config
        started = self._window if self._window is not None else time.perf_counter()
        await self.counters.start()
        payload_before = self.meter.report()
        asked = time.perf_counter()
        try:
            got = await self.bridge.next_batch(self.version)
        except StopAsyncIteration:
            return None
        batched = time.perf_counter()
        metrics = await asyncio.to_thread(self._update, got.batch)
        trained = time.perf_counter()
        sync_s = 0.0
        sync_bytes = 0
        published = False
        eval_wait_s = 0.0
        if metrics.skipped is None:  # the optimizer stepped: a new policy version
            # a validation pass runs at one version: the next publication waits for it (only it)
            eval_wait_s = await self._settle_eval()
            self.version += 1
            if self._publish is not None:
                sync_s = await asyncio.to_thread(self._publish, self.version)
                sync_bytes = self._published_bytes()
                published = True
        synced = time.perf_counter()
        metrics = replace(
            metrics, policy_version=self.version, weight_sync_s=sync_s, weight_sync_bytes=sync_bytes
        )
        env_mean, bonus_mean = group_rewards(got.groups)
        step = self.next_step
        self.next_step += 1
        model_delta, agent_delta = await self.counters.delta()
        ended = time.perf_counter()
        self._window = ended
        report = StepReport(
            step=step,
            total_steps=cfg.steps,
            metrics=metrics,
            batch=got,
            policy_version=self.version,
            published=published,
            weight_sync_s=sync_s,
            step_s=ended - started,
            env_reward_mean=env_mean,
            shaping_reward_mean=bonus_mean,
            shaped=self.shaping is not None,
            payload=payload_delta(payload_before, self.meter.report()),
            timing=split_step(
                step_s=ended - started,
                batch_wait_s=batched - asked,
                batch=got.timings,
                model=model_delta,
                agent=agent_delta,
                forward_backward_s=metrics.forward_backward_s,
                optimizer_s=metrics.optimizer_s,
                update_s=trained - batched,
                weight_sync_s=synced - trained - eval_wait_s,  # the wait is in `other`
                artifacts_s=self._tail["artifacts"],
                checkpoint_s=self._tail["checkpoint"],
            ),
            dp=self._dp_keys(),
            # kl_reference read now: fsdp workers take the reference after setup ("sharded")
            trainer={**self._trainer_keys, "kl_reference": self.trainer.kl_reference},
            counters_unavailable=self.counters.unavailable,
            generator=generator_keys(model_delta),
        )
        record = report.record()
        if self.validation is not None:
            record["eval_wait_s"] = round(eval_wait_s, 6)
        reporting = time.perf_counter()
        await asyncio.to_thread(self._report, report, record)
        checkpointing = time.perf_counter()
        if step == cfg.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
            await self.save_checkpoint(step)
        self._tail = {
            "artifacts": checkpointing - reporting,
            "checkpoint": time.perf_counter() - checkpointing,
        }
        if self.validation is not None and self.validation.due(step):
            if self.validation.running:  # a skipped step published nothing: the pass is still at v
                await self._settle_eval()
            last = step == cfg.steps
            self.validation.start(step=step, version=self.version, when="end" if last else "every")
        return report

    def _report(self, report: StepReport, record: dict[str, Any]) -> None:
        self.summary.add(report, record)
        for cb in self.callbacks:
            cb.on_step(report, record)

    def _published_bytes(self) -> int:
        """Bytes the last publication sent (0 when the publisher does not say)."""
        services = getattr(self, "services", None)  # not set on a run built from parts
        handle = services.generator if services is not None else None
        publisher = getattr(handle, "publisher", None)
        return int(getattr(publisher, "last_bytes", 0) or 0)

    def _dp_keys(self) -> dict[str, Any]:
        if self.dp is None:
            return {}
        return {
            "dp_backend": self.dp.backend,
            "dp_world_size": self.dp.num_workers,
            "dp_shard_tokens": list(self.dp.last_shard_tokens),
            "dp_media_dtypes": dict(self.dp.last_media_dtypes),
            "dp_weights_s": self.dp.last_weights_s,
            "dp_strategy": self.dp.strategy,
            "dp_rank_state_bytes": [dict(b) for b in self.dp.last_rank_state_bytes],
        }

    async def save_checkpoint(self, step: int) -> Path:
        """Write the checkpoint of ``step`` (weights, optimizer, RNG, the rows done).

        ``fsdp`` workers write their own slices into ``step-<s>/`` (the driver never holds the
        optimizer state); otherwise the driver writes one file, with rank 0's optimizer state."""
        from gymbridge.trainer.checkpoint import save_checkpoint, save_sharded_checkpoint

        self._checkpointed = step
        # the rows this process consumed and those its checkpoint had (a resumed run's bridge skips
        # them and knows only its own): a resume of a resumed run must not train them again
        done = self.bridge.done_task_indices.copy()
        done.update(self._done_task_indices)
        if self.dp is not None and self.dp.strategy == "fsdp":
            return await asyncio.to_thread(
                save_sharded_checkpoint,
                self.run_dir.checkpoints_path,
                step=step,
                policy_version=self.version,
                trainer=self.trainer,
                done_task_indices=done,
                write_shards=self.dp.save_sharded_checkpoint,
                keep=self.config.checkpoint.keep_last,
            )
        if self.dp is not None:  # the driver holds rank 0's weights; its optimizer state too now
            await asyncio.to_thread(self.dp.pull_optimizer_state)
        return await asyncio.to_thread(
            save_checkpoint,
            self.run_dir.checkpoints_path,
            step=step,
            policy_version=self.version,
            trainer=self.trainer,
            done_task_indices=done,
            keep=self.config.checkpoint.keep_last,
        )

    async def train(self) -> RunSummary:
        """Run the remaining steps, then say the summary; returns the :class:`RunSummary`."""
        if self.summary.nothing_to_do:
            return self.summary
        while self.next_step <= self.config.steps:
            if await self.step() is None:
                self.say(f"the dataset ran out after {self.next_step - 1} step(s)")
                break
        last = self.next_step - 1
        if last >= self.first_step and self._checkpointed != last:
            await self.save_checkpoint(last)  # a run's last step always has its checkpoint
        await self._settle_eval()
        v = self.validation
        final = v is not None and self.config.eval.final and self.first_step <= last
        if v is not None and final and last not in v.evaluated_steps:  # the data ran out before the end
            v.start(step=last, version=self.version, when="end")
            await self._settle_eval()
        await self._finish()
        return self.summary

    async def _finish(self) -> None:
        cfg = self.config
        s = self.summary
        if self._model_url is not None:
            s.model_media_cache = await _model_media_cache(self._model_url, self.say)
        s.rollouts_ok = self.bridge.stats.rollouts_ok
        s.rollouts_failed = self.bridge.stats.rollouts_failed
        s.bridge_stats = self.bridge.stats.as_dict()
        if s.steps_done:
            first, last = s.env_rewards[0], s.env_rewards[-1]
            if self.shaping is not None:
                shaped_first, shaped_last = first + s.shaping_rewards[0], last + s.shaping_rewards[-1]
                self.say(
                    f"\nshaped reward {shaped_first:.3f} -> {shaped_last:.3f} over {s.steps_done} steps "
                    f"(toy token_rate {self.shaping.chars!r}); env reward {first:.3f} -> {last:.3f}"
                )
            else:
                self.say(f"\nenv reward {first:.3f} -> {last:.3f} over {s.steps_done} steps")
        stats = self.bridge.stats  # per environment: the rows that named one (agent_ref)
        for env in sorted({*s.env_reward_spans, *stats.env_rollouts_ok, *stats.env_rollouts_failed}):
            span = s.env_reward_spans.get(env)
            rewards = (
                f"reward {span[0]:.3f} -> {span[1]:.3f} over the {span[2]} step(s) that trained it"
                if span is not None
                else "no step trained it"
            )
            ok, failed = stats.env_rollouts_ok.get(env, 0), stats.env_rollouts_failed.get(env, 0)
            self.say(f"  env {env}: {rewards}; {ok} rollouts ok, {failed} failed")
        split = median_split(s.step_seconds)
        if split:
            self.say("\n" + split)
        if cfg.output.payload_metrics:
            s.payload_table = self.meter.table()
            self.say("\npayload per boundary (pickle-5 bytes; ratio = logical / physical media bytes):")
            self.say(s.payload_table)
        if cfg.output.export == "final" and self._checkpointed:  # RUN_DIR/export/: docs/export.md
            from gymbridge.errors import CheckpointError
            from gymbridge.trainer.export import ModelParts, export_run

            out = self.run_dir.path / "export"
            parts = ModelParts.of_model(self.model.policy, self.model.processor, base_model=self.model.name)
            try:
                done = await asyncio.to_thread(
                    export_run,
                    self.run_dir.path,
                    out,
                    parts=parts,
                    dtype=cfg.trainer.dtype,
                    merge=cfg.output.export_merge,
                    overwrite=True,
                )
            except (CheckpointError, ConfigError, OSError, NotImplementedError) as exc:
                self.say(f"\nexport FAILED ({exc}); retry: gymbridge export {self.run_dir.path} --out DIR")
            else:
                s.export_dir = str(out)
                self.say(
                    f"\nexport: step {done.step} as {done.what} ({done.dtype}, "
                    f"{done.num_bytes / 2**20:.1f} MiB, {done.elapsed_s:.2f}s) -> {out}"
                )
        s.elapsed_s = time.perf_counter() - self._started
        st = s.bridge_stats
        stale = f", {st['groups_dropped_stale']} stale" if st.get("groups_dropped_stale") else ""
        skipped = s.steps_skipped
        dropped = st.get("groups_zero_variance_dropped", 0)
        self.say(
            f"\ndone: {s.steps_done} step(s)"
            + (f" ({skipped} skipped: no learning signal)" if skipped else "")
            + f", {s.rollouts_ok} rollouts ok, {s.rollouts_failed} failed ({st.get('groups_failed', 0)} "
            f"failed group(s), {st.get('groups_zero_variance', 0)} zero-variance{stale}"
            + (f", {dropped} zero-variance dropped by dynamic sampling" if dropped else "")
            + f"), {s.elapsed_s:.1f}s total; metrics: {self.run_dir.metrics_path}, "
            f"failures: {self.run_dir.failures_path}"
        )
        for warning in s.warnings():
            self.say(warning)
        await asyncio.to_thread(self._end)

    def _end(self) -> None:
        for cb in self.callbacks:
            cb.on_end(self.summary)

    # ------------------------------------------------------------------ cleanup
    async def cleanup(self) -> None:
        """Stop everything the run started (LIFO), close the callbacks."""
        self._set_up = False
        await self._stack.aclose()
        if not self.summary.elapsed_s:
            self.summary.elapsed_s = time.perf_counter() - self._started

    def _close_callbacks(self) -> None:
        for cb in self.callbacks:
            cb.close()


def resolve_run_env(config: RunConfig) -> Any:
    """What ``config`` trains on: the environment's spec, an :class:`~gymbridge.run.userenv.EnvMix` for
    ``env.mix``, ``None`` when agents of the user's own hold the environments (``env.agent_url``,
    ``env.head_url``)."""
    from gymbridge.run.userenv import resolve_env, resolve_mix

    if config.env.agent_url is not None or config.env.head_url is not None:
        return None
    if config.env.mix:
        return resolve_mix(config.env)
    if config.env.name is None:
        raise ConfigError(
            [
                "env.name: what to train on: --env NAME|module:Class, or --agent-url URL (or "
                "--head-url URL, or env.mix)"
            ]
        )
    return resolve_env(config.env.name)


def spec_modalities(spec: Any) -> tuple[str, ...]:
    """The media the model must take for ``spec`` (:func:`resolve_run_env`'s): its modalities, images
    when agents of the user's own hold the environment."""
    return tuple(spec.modalities) if spec is not None else ("image",)


def episode_turns(config: RunConfig, spec: Any) -> int:
    """Model calls an episode may take: ``rollout.max_turns``, else the environment's own (``spec``'s
    ``max_turns``; 1 when an agent of the user's own holds the environment, ``spec`` ``None``)."""
    if config.rollout.max_turns is not None:
        return config.rollout.max_turns
    return int(spec.max_turns) if spec is not None else 1


def _check_suppressed(suppress_token_ids: Sequence[int] | None, model_config: Any) -> None:
    """``trainer.suppress_token_ids`` must keep the model's media ids: every generator masks them
    (a sampled placeholder breaks the next turn's media), and the trainer must score what was sampled."""
    from gymbridge.generation.types import media_special_token_ids

    if suppress_token_ids is None:
        return
    missing = sorted(set(media_special_token_ids(model_config)) - set(suppress_token_ids))
    if missing:
        raise ConfigError(
            [
                f"trainer.suppress_token_ids leaves out the model's media ids {missing}, which the "
                "generator never samples: the trainer would score another distribution than the one "
                "sampled; list them too (or leave the key unset: the media ids only)"
            ]
        )


async def _model_media_cache(model_url: str, say: Callable[[str], None]) -> dict[str, Any]:
    """The model server's ``GET /media_cache`` counters, said as one line ({} when unavailable)."""
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
        say(
            f"model server media cache (once per content key): {shown}; "
            f"{stats.get('bytes', 0) / 2**20:.1f} MiB held"
        )
    return stats


def train(
    config: RunConfig,
    *,
    callbacks: Sequence[Callback] | None = None,
    resume: ResumeMode = "never",
    out: IO[str] | None = None,
    progress: bool = False,
) -> RunSummary:
    """Run ``config`` to the end on an event loop of its own; every server is stopped on return.

    ``gymbridge train`` is this function; see :class:`GRPORun` for the phases and ``resume``.
    """

    async def go() -> RunSummary:
        async with GRPORun(config, callbacks=callbacks, resume=resume, out=out, progress=progress) as run:
            return await run.train()

    return asyncio.run(go())
