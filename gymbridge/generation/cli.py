"""``gymbridge model serve``: run the model server from the command line.

::

    gymbridge model serve --tiny [--seed S] [--host H] [--port P] [--enable-weight-updates]
    gymbridge model serve --tiny-omni [--seed S] ...      # image, video and audio
    gymbridge model serve --model tiny:gemma3 [--seed S] ...   # a tiny family (docs/models.md)
    gymbridge model serve --model PATH [--backend hf|vllm] [--host H] [--port P]
    gymbridge model serve --model PATH --tool-parser qwen3_coder ...   # XML tool calls (Qwen3.5)

``--enable-weight-updates`` opens the ``/weights/*`` routes, through which a trainer joins a
weight group with the server and publishes each policy version (otherwise they answer 403). It needs
the run secret in the environment variable ``GYMBRIDGE_WEIGHTS_SECRET`` (at least 16 characters;
never a flag, which ``ps`` would show): without it the server refuses to start (exit 2), and every
weight call must carry ``Authorization: Bearer <secret>`` (else 401). The variable is removed from the
process's environment once read, so nothing the server starts inherits it;
``--enable-lora [--max-lora-rank R] [--max-loras N]`` (``--backend vllm`` only) starts vLLM with its
LoRA path on, for a LoRA trainer's adapters (docs/generation.md, "LoRA adapters on vLLM");
``--prompt-seed S`` seeds unseeded requests per prompt (``PromptSeededGenerator``), as the smoke
launcher does in its own process; ``--suppress-token-id ID`` (repeated) adds ids never to sample to
the model's media ids, as a trainer's ``suppress_token_ids`` asks (a run passes them);
``--tool-parser auto|hermes|qwen3_coder`` names the tool-call format generations are parsed in
(``auto``, the default: the one the chat template writes; docs/generation.md, "Tool-call formats").

:func:`add_model_commands` adds the ``model`` group's subcommands to an
``argparse`` sub-parser (the CLI's dispatch table points at it);
``python -m gymbridge.generation.cli serve ...`` runs the same command stand-alone.
The process serves until SIGINT / SIGTERM and prints one ``serving on URL`` line
to stdout once the port is bound (launchers and tests wait for it). A bad ``--model``
path (missing, a file, an empty or non-model directory) and a port that is out of range
or taken are refused before the model loads: one ``error:`` line, exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["add_model_commands", "build_generator", "check_model_dir", "main", "weight_sink_for"]

logger = logging.getLogger(__name__)


def add_model_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``model serve``."""
    from gymbridge.cli_common import DEFAULT_MODEL_PORT, add_address_arguments
    from gymbridge.generation.tool_calls import TOOL_PARSERS

    p = sub.add_parser("serve", help="serve a generator as a NeMo Gym model server (training mode)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tiny", action="store_true", help="the tiny offline random-weight Qwen2-VL")
    which.add_argument(
        "--tiny-omni",
        action="store_true",
        help="the tiny offline random-weight Qwen2.5-Omni thinker (image, video and audio)",
    )
    which.add_argument(
        "--model",
        metavar="PATH|tiny:FAMILY",
        help="a local Hugging Face model directory, or tiny:FAMILY (qwen2_vl, qwen2_5_vl, qwen3_vl, gemma3, "
        "internvl, qwen2_5_omni: a tiny offline random-weight model of that family)",
    )
    p.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="generation backend (default hf)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="weight seed of --tiny / --tiny-omni / --model tiny:FAMILY (default 0)",
    )
    add_address_arguments(p, DEFAULT_MODEL_PORT)
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    p.add_argument("--default-max-tokens", type=int, default=1024, help="max tokens when a request sets none")
    p.add_argument("--max-batch-size", type=int, default=64, help="rows per batched generate call")
    p.add_argument(
        "--no-reasoning-parser",
        action="store_true",
        help="leave <think> blocks in message content (for vllm_model with uses_reasoning_parser: false)",
    )
    p.add_argument(
        "--tool-parser",
        choices=TOOL_PARSERS,
        default="auto",
        help="tool-call format of the generations: hermes (<tool_call>{json}</tool_call>), qwen3_coder "
        "(<tool_call><function=NAME><parameter=P>...), or auto (default: the one the chat template writes)",
    )
    p.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="accept new policy weights from a trainer (POST /weights/*; refused otherwise); needs the run "
        "secret in $GYMBRIDGE_WEIGHTS_SECRET, which every weight call must present as a Bearer token",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="--backend vllm: serve a LoRA trainer's adapters through vLLM's LoRA path (engine arg "
        "enable_lora)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        metavar="R",
        help="--enable-lora: the largest adapter rank vLLM serves, >= trainer.lora.rank (vLLM's default 16; "
        "one of 1, 8, 16, 32, 64, 128, 256, 320, 512)",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=None,
        metavar="N",
        help="--enable-lora: adapters in one vLLM batch (default 2: a version and the one before it, "
        "whose requests are still finishing)",
    )
    for flag, kind, meaning in _VLLM_ENGINE_FLAGS:
        p.add_argument(flag, type=kind, default=None, help=f"--backend vllm: {meaning} (vLLM's default)")
    p.add_argument(
        "--prompt-seed", type=int, default=None, help="seed unseeded requests per prompt (reproducible runs)"
    )
    p.add_argument(
        "--suppress-token-id",
        type=int,
        action="append",
        default=[],
        metavar="ID",
        help="a token id never to sample, on top of the model's media ids (repeat it; a trainer's "
        "suppress_token_ids)",
    )
    p.add_argument("--allowed-local-root", action="append", default=[], help="media: allowed file:// root")
    p.add_argument("--allowed-http-host", action="append", default=[], help="media: allowed http(s) host")
    p.add_argument(
        "--media-host",
        action="append",
        default=[],
        help="media: host:port of a gymbridge media store (its /media/<key> references are fetched once "
        "and verified by key)",
    )
    p.add_argument(
        "--media-cache-bytes",
        type=int,
        default=None,
        help="bound of the cache of fetched / decoded / processed media by content key "
        "(default 512 MiB; 0: off); counters at GET /media_cache",
    )
    p.set_defaults(func=_cmd_serve)


def check_model_dir(path: str) -> Path:
    """``--model PATH`` as a directory that holds a model, else :class:`~gymbridge.errors.ConfigError`.

    Checked before anything is loaded: a missing path, a file, or a directory without a
    ``config.json`` each get one line saying what was found.
    """
    from gymbridge.errors import ConfigError

    model = Path(path).expanduser()
    if not model.exists():
        raise ConfigError(
            [f"--model {path}: no such file or directory (give a local Hugging Face model directory)"]
        )
    if not model.is_dir():
        raise ConfigError(
            [f"--model {path}: is a file, not a model directory (the folder holding config.json)"]
        )
    if not (model / "config.json").is_file():
        found = "is empty" if not any(model.iterdir()) else "has no config.json"
        raise ConfigError(
            [f"--model {path}: the directory {found}; it is not a Hugging Face model directory"]
        )
    return model


def build_generator(args: argparse.Namespace) -> Any:
    """The generator the arguments name."""
    from gymbridge.models.tiny_families import parse_tiny_spec

    reasoning = not args.no_reasoning_parser
    tool_parser = str(getattr(args, "tool_parser", "auto"))
    suppressed = tuple(getattr(args, "suppress_token_id", None) or ())
    lora_engine_args = {**_vllm_lora_args(args), **_vllm_engine_args(args)}
    tiny_omni = bool(getattr(args, "tiny_omni", False))
    family = parse_tiny_spec(args.model) if args.model is not None else None
    if (args.tiny or tiny_omni or family is not None) and args.backend != "hf":
        from gymbridge.errors import ConfigError

        flag = "--tiny-omni" if tiny_omni else "--tiny" if args.tiny else f"--model {args.model}"
        raise ConfigError([f"{flag} is the transformers model: it runs on --backend hf only"])
    if family is not None:
        from gymbridge.generation.hf import HFGenerator

        return HFGenerator.tiny_family(
            family,
            args.seed,
            max_model_len=args.max_model_len,
            reasoning_parser=reasoning,
            tool_parser=tool_parser,
            suppress_token_ids=suppressed,
        )
    if args.tiny or tiny_omni:
        from gymbridge.generation.hf import HFGenerator

        build = HFGenerator.tiny_omni if tiny_omni else HFGenerator.tiny
        return build(
            args.seed,
            max_model_len=args.max_model_len,
            reasoning_parser=reasoning,
            tool_parser=tool_parser,
            suppress_token_ids=suppressed,
        )
    if args.backend == "vllm":
        from gymbridge.generation.vllm import VLLMGenerator

        return VLLMGenerator(
            args.model,
            engine_args=lora_engine_args or None,
            max_model_len=args.max_model_len,
            reasoning_parser=reasoning,
            tool_parser=tool_parser,
            suppress_token_ids=suppressed,
        )
    from gymbridge.generation.hf import HFGenerator

    return HFGenerator.from_pretrained(
        args.model,
        max_model_len=args.max_model_len,
        reasoning_parser=reasoning,
        tool_parser=tool_parser,
        suppress_token_ids=suppressed,
    )


DEFAULT_MAX_LORAS = 2
"""vLLM's ``max_loras`` with ``--enable-lora``: the current adapter version and the one before it (its
requests in flight finish on it), in one batch."""


_VLLM_ENGINE_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--tensor-parallel-size", int, "GPUs one engine shards the model over"),
    ("--gpu-memory-utilization", float, "share of the GPU memory the engine takes"),
    ("--dtype", str, "weights' and activations' dtype (auto, bfloat16, float16, float32)"),
    ("--max-num-seqs", int, "sequences in one engine step"),
)
"""vLLM engine arguments ``model serve`` passes through (a run's ``generator.*`` of the same names)."""


def _vllm_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments of :data:`_VLLM_ENGINE_FLAGS` given (``{}``: none); on another backend a
    ``ConfigError``."""
    from gymbridge.errors import ConfigError

    names = [flag.removeprefix("--").replace("-", "_") for flag, _, _ in _VLLM_ENGINE_FLAGS]
    given = {name: getattr(args, name, None) for name in names}
    given = {name: value for name, value in given.items() if value is not None}
    if given and args.backend != "vllm":
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ConfigError([f"{flags}: vLLM engine arguments, for --backend vllm only"])
    return given


def _vllm_lora_args(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM engine args of ``--enable-lora`` / ``--max-lora-rank`` / ``--max-loras`` (``{}`` without
    ``--enable-lora``); the flags without it, or on another backend, are a ``ConfigError``."""
    from gymbridge.errors import ConfigError

    max_rank = getattr(args, "max_lora_rank", None)
    max_loras = getattr(args, "max_loras", None)
    if not getattr(args, "enable_lora", False):
        if max_rank is not None or max_loras is not None:
            raise ConfigError(["--max-lora-rank / --max-loras configure vLLM's LoRA path: add --enable-lora"])
        return {}
    if args.backend != "vllm":
        hint = "the hf backend takes a LoRA trainer's adapters without it"
        raise ConfigError([f"--enable-lora is a vLLM engine flag (--backend vllm); {hint}"])
    for flag, value in (("--max-lora-rank", max_rank), ("--max-loras", max_loras)):
        if value is not None and value < 1:
            raise ConfigError([f"{flag} must be >= 1, got {value}"])
    engine_args: dict[str, Any] = {"enable_lora": True, "max_loras": max_loras or DEFAULT_MAX_LORAS}
    if max_rank is not None:
        engine_args["max_lora_rank"] = max_rank
    return engine_args


def weight_sink_for(generator: Any) -> Any:
    """The :class:`~gymbridge.generation.weights.WeightSink` that loads weights into ``generator``."""
    from gymbridge.generation.hf import HFGenerator

    if isinstance(generator, HFGenerator):
        from gymbridge.generation.weights import WeightReceiver

        return WeightReceiver(generator)
    from gymbridge.generation.vllm import VLLMWeightSink

    return VLLMWeightSink(generator)


def _weights_secret(*, enabled: bool) -> str | None:
    """The run secret from ``GYMBRIDGE_WEIGHTS_SECRET``, taken out of this process's environment (no
    child inherits it); ``None`` without ``--enable-weight-updates``. Enabled without one (or with a
    short one): a :class:`~gymbridge.errors.ConfigError` that never shows the value."""
    from gymbridge.errors import ConfigError
    from gymbridge.generation.server import WEIGHTS_SECRET_ENV, check_weights_secret

    secret = os.environ.pop(WEIGHTS_SECRET_ENV, "")
    if not enabled:
        return None
    if not secret:
        raise ConfigError(
            [
                f"--enable-weight-updates needs the run secret in ${WEIGHTS_SECRET_ENV} (the trainer "
                "sends it with every weight call; a launcher sets it for its child): without it anyone "
                "who reaches the port could replace the weights"
            ]
        )
    try:
        check_weights_secret(secret)
    except ValueError as exc:
        raise ConfigError([f"${WEIGHTS_SECRET_ENV}: {exc}"]) from exc
    return secret


async def _serve(args: argparse.Namespace) -> None:
    from gymbridge.models.tiny_families import parse_tiny_spec
    from gymbridge.serving import probe_port, serve_until_stopped

    if args.model is not None and parse_tiny_spec(args.model) is None:
        check_model_dir(args.model)
    probe_port(args.host, args.port)  # a taken port fails now, before torch and the model load

    from gymbridge.generation.server import ModelServer, ModelServerConfig
    from gymbridge.media import MediaPolicy

    secret = _weights_secret(enabled=args.enable_weight_updates)  # before the model loads
    generator = build_generator(args)
    config = ModelServerConfig(
        model_name=str(getattr(generator, "model_name", args.model or "gymbridge-model")),
        max_model_len=int(generator.max_model_len),
        default_max_tokens=args.default_max_tokens,
        reasoning_parser=not args.no_reasoning_parser,
        max_batch_size=args.max_batch_size,
        **({} if args.media_cache_bytes is None else {"media_cache_bytes": args.media_cache_bytes}),
    )
    policy = MediaPolicy(
        allowed_local_roots=tuple(Path(r) for r in args.allowed_local_root),
        allowed_http_hosts=tuple(args.allowed_http_host),
        media_hosts=tuple(args.media_host),
    )
    sink: Any = None
    if args.enable_weight_updates:
        sink = weight_sink_for(generator)
    served: Any = generator
    if args.prompt_seed is not None:
        from gymbridge.generation.seeding import PromptSeededGenerator

        served = PromptSeededGenerator(generator, args.prompt_seed)
    server = ModelServer(served, config=config, media_policy=policy, weight_sink=sink, weights_secret=secret)

    def announce() -> None:
        print(f"serving on {server.url} (OpenAI base URL {server.url}/v1)", flush=True)

    await serve_until_stopped(lambda: server.start(args.host, args.port), server.stop, announce)


def _cmd_serve(args: argparse.Namespace) -> int:
    asyncio.run(_serve(args))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry: ``python -m gymbridge.generation.cli serve ...``."""
    from gymbridge.cli_common import run_command

    parser = argparse.ArgumentParser(prog="gymbridge model")
    add_model_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run_command(args, prog="gymbridge model", log_level="INFO")


if __name__ == "__main__":
    sys.exit(main())
