"""``gymbridge eval``: one validation pass alone, with the metrics a run's ``eval.jsonl`` holds.

::

    gymbridge eval RUN_DIR [--step N]                 # a run's checkpoint (newest, or step N)
    gymbridge eval --model DIR --env NAME             # a model directory (gymbridge export's included)
    gymbridge eval --agent-url URL --data rows.jsonl  # a running NeMo Gym agent, as it is

Each sends ``--max-prompts`` prompts ``-n`` times (``--data`` rows, else the environment's
generated validation rows, :func:`~gymbridge.run.evaluation.eval_rows`) through the same rollout
path a run uses and reports mean reward, pass@k, pass@1[avg-of-k] and, with ``--answer-key``,
majority@k, per environment too (:func:`~gymbridge.run.evaluation.evaluate`). A run directory is
evaluated with its own saved config: its environment, model, generator and rollout settings, the
checkpoint's weights (a LoRA checkpoint's adapters on the base) published to the generator as
the checkpoint's policy version. A model directory or ``--env`` takes the run defaults plus
``--config`` / ``--set``. An agent is evaluated with whatever model it calls.

Output: a one-screen summary on stdout; ``--out FILE.json`` writes the pass's record (the
``eval.jsonl`` shape plus ``source``) and ``--rollouts FILE.jsonl`` its rollout lines. Nothing is
written into the run directory. Exit status 0 when the pass ran (whatever its score), 2 on a
:class:`~gymbridge.errors.GymbridgeError` (bad input, a checkpoint that does not load), and 1 when
every rollout failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from gymbridge.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from gymbridge.run.config import RunConfig
    from gymbridge.run.evaluation import EvalPass
    from gymbridge.run.model import RunModel

__all__ = ["add_eval_arguments", "evaluate_agent", "evaluate_config", "load_checkpoint_weights"]


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """``gymbridge eval``'s options (the ``gymbridge.cli`` hook)."""
    from gymbridge.run.cli import add_config_arguments

    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", type=Path, nargs="?", default=None, help="a run directory to evaluate"
    )
    parser.add_argument(
        "--step", type=int, default=None, help="RUN_DIR's checkpoint of this step (default: newest)"
    )
    parser.add_argument("--model", default=None, metavar="DIR|tiny", help="a model directory to evaluate")
    parser.add_argument("--env", default=None, help="the environment (with --model): a name or module:Class")
    parser.add_argument("--agent-url", default=None, help="a running NeMo Gym agent to evaluate (POST /run)")
    parser.add_argument("--data", default=None, help="NeMo Gym rows (jsonl) to evaluate on")
    parser.add_argument("-n", type=int, default=None, help="samples per prompt, the k of pass@k (default 4)")
    parser.add_argument("--max-prompts", type=int, default=None, help="prompts to evaluate (default 64)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (0: greedy)")
    parser.add_argument(
        "--answer-key", default=None, help="result field of the extracted answer (majority@k)"
    )
    add_config_arguments(
        parser,
        config_help="run overlays (--model)",
        set_help="override a run config key (--model, --env), e.g. --set rollout.max_tokens=64",
    )
    parser.add_argument("--out", type=Path, default=None, metavar="FILE.json", help="write the pass's record")
    parser.add_argument(
        "--rollouts", type=Path, default=None, metavar="FILE.jsonl", help="write its rollouts"
    )
    parser.set_defaults(func=_cmd_eval)


def _eval_overrides(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "data": args.data,
        "n": args.n,
        "max_prompts": args.max_prompts,
        "temperature": args.temperature,
        "answer_key": args.answer_key,
    }
    return {k: v for k, v in given.items() if v is not None}


def _with_eval(cfg: RunConfig, eval_keys: dict[str, Any]) -> RunConfig:
    from gymbridge.run.config import RunConfig

    data = cfg.model_dump(mode="json")
    data["eval"] = {**data.get("eval", {}), **eval_keys}
    data["generator"] = {**data.get("generator", {}), "publish_weights": True}
    try:
        return RunConfig.model_validate(data)
    except ValueError as exc:
        raise ConfigError([str(exc)]) from exc


def load_checkpoint_weights(model: RunModel, checkpoint: Path) -> int:
    """Load ``checkpoint``'s policy weights into ``model.policy`` (a LoRA checkpoint's adapters are
    injected first, as the run had them); returns its policy version.

    Every tensor of the checkpoint must land on a parameter or buffer of the policy with the same
    shape (a checkpoint of another model is a :class:`CheckpointError` naming the first misfit)."""
    import torch

    from gymbridge.generation.lora import apply_lora
    from gymbridge.trainer.export import checkpoint_lora, checkpoint_meta, checkpoint_tensors

    meta = checkpoint_meta(checkpoint)
    lora = checkpoint_lora(checkpoint)
    policy = model.policy
    if lora is not None:
        apply_lora(policy, lora)
    state = policy.state_dict()
    loaded = 0
    with torch.no_grad():
        for name, tensor in checkpoint_tensors(checkpoint):
            target = state.get(name)
            if target is None or target.shape != tensor.shape:
                what = "no such weight" if target is None else f"shape {tuple(target.shape)}"
                raise CheckpointError(
                    checkpoint,
                    f"{name} {tuple(tensor.shape)} does not fit {model.name} ({what}): "
                    "a checkpoint of another model?",
                )
            target.copy_(tensor.to(target.dtype))
            loaded += 1
    if not loaded:
        raise CheckpointError(checkpoint, "holds no policy weights")
    return int(meta.get("policy_version", meta.get("step", 0)))


async def evaluate_config(
    cfg: RunConfig, *, checkpoint: Path | None = None, log_dir: Path | None = None
) -> EvalPass:
    """One validation pass of ``cfg``'s model (``checkpoint``'s weights when given) on its environment,
    over the services a run would start (stopped on return); nothing is written."""
    from gymbridge.metrics import PayloadMeter
    from gymbridge.run.evaluation import EvalPass, eval_rows, evaluate
    from gymbridge.run.model import pick_model
    from gymbridge.run.recipe import episode_turns, resolve_run_env, spec_modalities
    from gymbridge.run.services import start_services

    spec = resolve_run_env(cfg)
    rows = eval_rows(cfg, spec)
    model = pick_model(cfg.model.name, cfg.model.seed, spec_modalities(spec), cfg.model.backend)
    version = 0
    if checkpoint is not None:
        version = await asyncio.to_thread(load_checkpoint_weights, model, checkpoint)
    model.policy.to(cfg.trainer.torch_dtype)
    with contextlib.ExitStack() as files:
        logs = log_dir or Path(files.enter_context(tempfile.TemporaryDirectory(prefix="gymbridge-eval-")))
        async with contextlib.AsyncExitStack() as stack:
            services = await start_services(
                cfg,
                stack,
                model=model,
                spec=spec,
                max_turns=episode_turns(cfg, spec),
                run_path=logs,
                meter=PayloadMeter(enabled=False),
            )
            await asyncio.to_thread(services.generator.publish, model.policy, version)
            metrics, lines = await evaluate(
                rows,
                services.source,
                n=cfg.eval.n,
                default_env=cfg.env_label,
                answer_key=cfg.eval.answer_key,
                concurrency=cfg.bridge.prompts_per_step,
            )
    record = {"step": None, "policy_version": version, "when": "once", **_settings(cfg), **metrics}
    return EvalPass(record, lines)


def _settings(cfg: RunConfig) -> dict[str, Any]:
    e = cfg.eval
    return {"n": e.n, "temperature": e.temperature if e.temperature is not None else cfg.trainer.temperature}


async def evaluate_agent(cfg: RunConfig, agent_url: str) -> EvalPass:
    """One validation pass through a running agent (its model is whatever it calls)."""
    from gymbridge.bridge import GymRollouts
    from gymbridge.client import GymClient
    from gymbridge.run.evaluation import EvalPass, eval_rows, evaluate

    rows = eval_rows(cfg, None)
    async with GymClient(agent_url, deadline_s=cfg.rollout.deadline_s) as client:
        source = GymRollouts(client, deadline_s=cfg.rollout.deadline_s)
        metrics, lines = await evaluate(
            rows,
            source,
            n=cfg.eval.n,
            default_env="agent",
            answer_key=cfg.eval.answer_key,
            concurrency=cfg.bridge.prompts_per_step,
        )
    record = {"step": None, "policy_version": None, "when": "once", **_settings(cfg), **metrics}
    return EvalPass(record, lines)


def _config(args: argparse.Namespace) -> tuple[RunConfig, Path | None, str]:
    """The run config to evaluate, the checkpoint (``None``: the model's own weights), and a label."""
    from gymbridge.run.config import load_run_config
    from gymbridge.run.rundir import RunDir

    modes = [
        m
        for m, on in (("RUN_DIR", args.run_dir), ("--model", args.model), ("--agent-url", args.agent_url))
        if on
    ]
    if len(modes) != 1:
        raise ConfigError(
            [f"gymbridge eval takes one of RUN_DIR, --model DIR or --agent-url URL (got {modes or 'none'})"]
        )
    eval_keys = _eval_overrides(args)
    if args.run_dir is not None:
        from gymbridge.run.cli import _saved_config
        from gymbridge.trainer.export import find_checkpoint

        if args.configs or args.overrides or args.env:
            raise ConfigError(
                ["RUN_DIR is evaluated with its saved config.yaml: drop --config, --set and --env"]
            )
        cfg = _saved_config(args.run_dir)
        checkpoint, step = find_checkpoint(RunDir(args.run_dir).checkpoints_path, args.step)
        return _with_eval(cfg, eval_keys), checkpoint, f"{args.run_dir} step {step}"
    if args.step is not None:
        raise ConfigError(["--step picks a checkpoint of RUN_DIR"])
    flags: dict[str, Any] = {"env": args.env}
    if args.model is not None:
        flags["model"] = args.model
        if args.env is None:
            raise ConfigError(["--model: give --env NAME|module:Class (what to evaluate it on)"])
    else:
        flags["agent_url"] = args.agent_url
        if args.data is None:
            raise ConfigError(["--agent-url: give --data (the NeMo Gym rows the agent runs)"])
        flags["dataset"] = args.data
    cfg = load_run_config(args.configs, list(args.overrides), flags)
    label = args.model if args.model is not None else args.agent_url
    return _with_eval(cfg, eval_keys), None, str(label)


def _cmd_eval(args: argparse.Namespace) -> int:
    import logging

    from gymbridge.metrics import summary_lines
    from gymbridge.run.evaluation import describe_pass

    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg, checkpoint, label = _config(args)
    if args.agent_url is not None:
        done = asyncio.run(evaluate_agent(cfg, args.agent_url))
    else:
        done = asyncio.run(evaluate_config(cfg, checkpoint=checkpoint))
    record = {**done.record, "source": label}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
    if args.rollouts is not None:
        args.rollouts.parent.mkdir(parents=True, exist_ok=True)
        args.rollouts.write_bytes(b"".join(orjson.dumps(line, default=str) + b"\n" for line in done.rollouts))
    print(f"eval of {label}:")
    print(describe_pass(record))
    for line in summary_lines(record.get("metrics") or {}, k=cfg.eval.n):
        print(f"  {line}")
    for name, part in (record.get("env") or {}).items() if len(record.get("env") or {}) > 1 else ():
        print(f"  {name}:")
        for line in summary_lines(part.get("metrics") or {}, k=cfg.eval.n):
            print(f"    {line}")
    if args.out is not None:
        print(f"record: {args.out}", file=sys.stderr)
    return 1 if record.get("rollouts_ok", 0) == 0 else 0
