"""``gymbridge train`` and its short alias ``gymbridge smoke run`` (= ``train --config smoke``).

::

    gymbridge train --env my_pkg.envs:MyEnv --dataset rows.jsonl --model /models/qwen2-vl-2b
    gymbridge train --agent-url http://127.0.0.1:8000 --dataset rows.jsonl --model-port 8010
    gymbridge train --head-url http://127.0.0.1:11000 --dataset mixed_rows.jsonl --model-port 8010
    gymbridge train --config smoke --set trainer.lr=1e-3 --steps 20
    gymbridge smoke run --model tiny:gemma3 --steps 2     # a tiny model of one VLM family
    gymbridge train --resume runs/color_pick-20261202T101500Z
    gymbridge smoke run [--native | --config smoke_color_tool | --env beep_count ...]
    gymbridge export runs/color_pick-20261202T101500Z --out exported/ [--step 20] [--dtype bfloat16]

``--config`` takes shipped overlays by name (``gymbridge/configs/``) or YAML files, in order;
``--set KEY=VALUE`` (dotted, YAML-typed) comes after them, the named flags last
(:func:`~gymbridge.run.config.load_run_config`). ``--resume DIR`` continues the run saved in
``DIR`` from its newest checkpoint (and refuses a run without one); ``--resume-or-start DIR``
starts it afresh in ``DIR`` when it has none. ``gymbridge smoke run --env NAME`` runs an example
environment at its small smoke size (its data module's ``SMOKE_PARAMS``).

``gymbridge export RUN_DIR --out DIR`` writes the run's newest checkpoint (or ``--step N``) as a
Hugging Face model directory, or a LoRA run's as a peft adapter directory (``--merge``: the merged
model, the adapter in ``DIR/adapter/``; :func:`gymbridge.trainer.export.export_run`,
docs/export.md); the model class, config, processor and base weights are rebuilt offline from the
run's ``config.yaml`` (:func:`run_model_parts`).

Invariant: nothing here trains; it turns the command line into a :class:`~gymbridge.run.RunConfig`
and calls :func:`gymbridge.run.train` (or, for ``export``, the exporter).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gymbridge.config import parse_override
from gymbridge.errors import ConfigError

if TYPE_CHECKING:
    from gymbridge.run.config import RunConfig
    from gymbridge.trainer.export import ModelParts

__all__ = [
    "add_config_arguments",
    "add_export_arguments",
    "add_smoke_commands",
    "add_train_arguments",
    "run_model_parts",
]

SMOKE_CONFIG = "smoke"
"""The overlay ``gymbridge smoke run`` uses when given no ``--config``."""


def add_run_arguments(parser: argparse.ArgumentParser, *, smoke: bool) -> None:
    """The run's options, on any parser (``smoke``: the alias's help texts)."""
    default = f" (default: {SMOKE_CONFIG})" if smoke else ""
    add_config_arguments(
        parser,
        config_help=f"a shipped overlay's name or a YAML file; repeat to stack overlays in order{default}",
        set_help="override any config key (dotted, YAML-typed), e.g. --set trainer.lr=1e-3",
    )
    parser.add_argument(
        "--env", default=None, help="environment: a name (gymbridge env list) or module:Class (your server)"
    )
    parser.add_argument(
        "--agent-url", default=None, help="a running NeMo Gym agent (POST /run): serve the model only"
    )
    parser.add_argument(
        "--head-url",
        default=None,
        help="a running NeMo Gym head server: each row's agent_ref picks its agent; serve the model only",
    )
    parser.add_argument("--dataset", default=None, help="NeMo Gym rows (jsonl) to train on")
    parser.add_argument(
        "--model",
        default=None,
        metavar="tiny|tiny:FAMILY|PATH",
        help="tiny (default; by the env's modalities), tiny:FAMILY (qwen2_vl, qwen2_5_vl, qwen3_vl, gemma3, "
        "internvl, qwen2_5_omni: a tiny offline model of that family, docs/models.md) or a local Hugging "
        "Face model directory",
    )
    parser.add_argument(
        "--backend", choices=("hf", "vllm"), default=None, help="generation backend of --model"
    )
    parser.add_argument(
        "--model-port", type=int, default=None, help="the model server's port (for --agent-url, --head-url)"
    )
    parser.add_argument("--native", action="store_true", default=None, help="native rollouts (no agent)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps")
    parser.add_argument("--prompts", dest="prompts_per_step", type=int, default=None, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=None, help="rollouts per prompt (G)")
    parser.add_argument("--seed", type=int, default=None, help="dataset and sampling seed")
    parser.add_argument("--dp", dest="dp_workers", type=int, default=None, help="Ray DP workers (0: none)")
    parser.add_argument(
        "--run-dir", default=None, help="the run directory (default runs/<env>-<UTC timestamp>)"
    )
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        metavar="RUN_DIR",
        type=Path,
        default=None,
        help="continue the run in RUN_DIR from its newest checkpoint (refused when it has none)",
    )
    resume.add_argument(
        "--resume-or-start",
        metavar="RUN_DIR",
        type=Path,
        default=None,
        help="continue the run in RUN_DIR, or start it there afresh when it has no checkpoint",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=_cmd_smoke if smoke else _cmd_train, smoke=smoke)


def add_config_arguments(parser: argparse.ArgumentParser, *, config_help: str, set_help: str) -> None:
    """``--config NAME|FILE`` (repeatable: ``configs``) and ``--set KEY=VALUE`` (``overrides``)."""
    parser.add_argument(
        "--config", dest="configs", action="append", default=[], metavar="NAME|FILE", help=config_help
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        type=parse_override,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=set_help,
    )


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """``gymbridge train``'s options (the ``gymbridge.cli`` hook)."""
    add_run_arguments(parser, smoke=False)


def add_smoke_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``gymbridge smoke run``: ``train --config smoke`` (the ``gymbridge.cli`` dispatch-table hook)."""
    p_run = sub.add_parser("run", help="the colour toy end to end on loopback (train --config smoke)")
    add_run_arguments(p_run, smoke=True)


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    from gymbridge.run.config import FLAG_KEYS

    return {k: getattr(args, k) for k in FLAG_KEYS if getattr(args, k, None) is not None}


def _cmd_smoke(args: argparse.Namespace) -> int:
    return _run(args, default_configs=[SMOKE_CONFIG])


def _cmd_train(args: argparse.Namespace) -> int:
    return _run(args, default_configs=[])


def _run(args: argparse.Namespace, *, default_configs: list[str]) -> int:
    from gymbridge.run.config import load_run_config, saved_run_config
    from gymbridge.run.recipe import train
    from gymbridge.run.rundir import RunDir

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per /run call drowns the steps
    flags = _flags(args)
    progress = not args.no_progress
    saved_dir: Path | None = args.resume or args.resume_or_start
    if saved_dir is not None and (RunDir(saved_dir).config_path.is_file() or args.resume is not None):
        given = [f"--{k.replace('_', '-')}" for k in flags] + [
            f"--set {o.partition('=')[0]}" for o in args.overrides
        ]
        given += ["--config"] if args.configs else []
        if given:
            raise ConfigError(
                [f"--resume continues the run as saved in {saved_dir}/config.yaml; drop {', '.join(given)}"]
            )
        run = RunDir(saved_dir)
        if not run.config_path.is_file():
            raise ConfigError([f"--resume {saved_dir}: not a run directory (no config.yaml)"])
        data = run.read_config()
        data.setdefault("output", {})
        data["output"] = {**data["output"], "run_dir": str(saved_dir)}
        cfg = saved_run_config(data, where=str(run.config_path))
        train(cfg, resume="must" if args.resume is not None else "allow", progress=progress)
        return 0
    configs = list(args.configs) or default_configs
    overrides = list(args.overrides)
    if args.smoke and args.env is not None:
        overrides.insert(0, ("env.params", _smoke_params(args.env)))
    if args.backend == "vllm" and not any(str(o).startswith("generator.placement=") for o in overrides):
        overrides.insert(0, "generator.placement=process")  # vLLM serves from its own process
    if saved_dir is not None:
        flags["run_dir"] = str(saved_dir)
    cfg = load_run_config(configs, overrides, flags)
    train(cfg, resume="allow" if saved_dir is not None else "never", progress=progress)
    return 0


def _smoke_params(env: str) -> dict[str, Any]:
    """An example environment's small smoke size (``SMOKE_PARAMS`` of its data module; ``{}``: none)."""
    from gymbridge.run.userenv import is_class_ref

    if is_class_ref(env):
        return {}
    from gymbridge.cli_common import load_example_environments

    return dict(load_example_environments().get_env(env).smoke_params)


# ---------------------------------------------------------------------------------------- export
def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """``gymbridge export``'s options (the ``gymbridge.cli`` hook)."""
    parser.description = (
        "Write a run's checkpoint (the newest, or --step N) as a Hugging Face model directory: "
        "safetensors weights (sharded past --max-shard-size, with model.safetensors.index.json), "
        "config.json, generation_config.json and the processor / tokenizer / chat template. "
        "transformers' from_pretrained, vLLM, `gymbridge model serve --model DIR` and "
        "`gymbridge train --model DIR` load it as is. A LoRA run's checkpoint is written as a peft "
        "adapter directory (adapter_config.json, adapter_model.safetensors, the processor files; "
        "PeftModel.from_pretrained loads it onto the run's base model), or with --merge as the model "
        "above with the adapters merged in and the adapter in DIR/adapter/ (docs/export.md)."
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run directory (holds config.yaml)")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="the directory to write")
    parser.add_argument(
        "--step", type=int, default=None, help="the checkpoint of this step (default: the newest)"
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="the weights' dtype (default: the run's trainer.dtype)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest weights file, as save_pretrained reads it (5GB, 500MB, 2GiB; default 5GB)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: write the model with the adapters merged into its base weights at DIR, as a "
        "full fine-tuning run's export, and the adapter in DIR/adapter/ (default: the adapter at DIR); "
        "a full fine-tuning run's export is the model either way",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace DIR when it exists and is not empty"
    )
    parser.set_defaults(func=_cmd_export)


def _saved_config(run_dir: Path) -> RunConfig:
    from gymbridge.run.config import saved_run_config
    from gymbridge.run.rundir import RunDir

    run = RunDir(run_dir)
    if not run.config_path.is_file():
        raise ConfigError([f"{run_dir}: not a run directory (no config.yaml)"])
    return saved_run_config(run.read_config(), where=str(run.config_path))


def run_model_parts(config: RunConfig) -> ModelParts:
    """What an export of a run of ``config`` takes from its model, rebuilt offline.

    A tiny model is rebuilt from its seed (its class, config, processor and, for a LoRA run's merge,
    its weights; ``tiny`` by the environment's modalities, as the run picked it); a model directory
    gives its config, has its processor / tokenizer files copied and its safetensors read as the
    base weights of a merge (:func:`~gymbridge.trainer.export.model_dir_weights`, lazily).
    """
    import functools

    from gymbridge.trainer.export import ModelParts, model_dir_weights

    name = config.model.name
    if config.model.is_tiny:
        from gymbridge.run.model import pick_model

        modalities: tuple[str, ...] = ("image",)
        if name == "tiny" and config.env.mix:  # the model the run picked: every environment's media
            from gymbridge.run.userenv import resolve_mix

            modalities = resolve_mix(config.env).modalities
        elif name == "tiny" and config.env.agent_url is None and config.env.name is not None:
            from gymbridge.run.userenv import resolve_env

            modalities = tuple(resolve_env(config.env.name).modalities)
        model = pick_model(name, config.model.seed, modalities)
        return ModelParts.of_model(model.policy, model.processor, base_model=model.name)
    import transformers

    from gymbridge.generation.cli import check_model_dir

    folder = check_model_dir(name)
    hf_config: Any = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    classes = [getattr(transformers, a, None) for a in (hf_config.architectures or [])]
    model_class = next((c for c in classes if isinstance(c, type)), None)
    if model_class is None:
        raise ConfigError(
            [f"model {name}: config.json names no transformers class ({hf_config.architectures})"]
        )
    generation: Any = None
    if (folder / "generation_config.json").is_file():
        generation = transformers.GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    return ModelParts(
        model_class,
        hf_config,
        generation,
        processor_dir=folder,
        base_weights=functools.partial(model_dir_weights, folder, model_class, hf_config),
        base_model=str(folder.resolve()),
    )


def _cmd_export(args: argparse.Namespace) -> int:
    import sys

    from gymbridge.trainer.export import ShardWritten, export_run

    config = _saved_config(args.run_dir)
    dtype = args.dtype or config.trainer.dtype
    print(
        f"export: {args.run_dir} -> {args.out} ({dtype}, shards up to {args.max_shard_size})", file=sys.stderr
    )

    def progress(shard: ShardWritten) -> None:
        print(
            f"  shard {shard.index}: {shard.num_tensors} tensors, {shard.num_bytes / 2**20:.1f} MiB",
            file=sys.stderr,
            flush=True,
        )

    result = export_run(
        args.run_dir,
        args.out,
        parts=run_model_parts(config),
        step=args.step,
        dtype=dtype,
        max_shard_size=args.max_shard_size,
        merge=args.merge,
        overwrite=args.overwrite,
        on_shard=progress,
    )
    what = "" if result.kind == "full" else f" as {result.what}"
    print(
        f"exported step {result.step} ({result.checkpoint.name}) to {result.out_dir}{what}: "
        f"{result.num_tensors} tensors, {result.num_bytes / 2**20:.1f} MiB in {len(result.files)} file(s), "
        f"{result.elapsed_s:.1f}s",
        file=sys.stderr,
    )
    return 0
