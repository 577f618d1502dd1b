"""``gymbridge model serve``: run the model server from the command line.

::

    gymbridge model serve --tiny [--seed S] [--host H] [--port P] [--enable-weight-updates]
    gymbridge model serve --model PATH [--backend hf|vllm] [--host H] [--port P]

``--enable-weight-updates`` opens the ``/weights/*`` routes, through which a trainer joins a
weight group with the server and publishes each policy version (otherwise they answer 403);
``--prompt-seed S`` seeds unseeded requests per prompt (``PromptSeededGenerator``), as the smoke
launcher does in its own process.

:func:`add_model_commands` adds the ``model`` group's subcommands to an
``argparse`` sub-parser (the CLI's dispatch table points at it);
``python -m gymbridge.generation.cli serve ...`` runs the same command stand-alone.
The process serves until SIGINT / SIGTERM and prints one ``serving on URL`` line
to stdout once the port is bound (launchers and tests wait for it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["add_model_commands", "build_generator", "main", "weight_sink_for"]

logger = logging.getLogger(__name__)


def add_model_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``model serve``."""
    p = sub.add_parser("serve", help="serve a generator as a NeMo Gym model server (training mode)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tiny", action="store_true", help="the tiny offline random-weight Qwen2-VL")
    which.add_argument("--model", metavar="PATH", help="a local Hugging Face model directory")
    p.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="generation backend (default hf)")
    p.add_argument("--seed", type=int, default=0, help="weight seed of --tiny (default 0)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port, 0 for a free one (default 8000)")
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    p.add_argument("--default-max-tokens", type=int, default=1024, help="max tokens when a request sets none")
    p.add_argument("--max-batch-size", type=int, default=64, help="rows per batched generate call")
    p.add_argument(
        "--no-reasoning-parser",
        action="store_true",
        help="leave <think> blocks in message content (for vllm_model with uses_reasoning_parser: false)",
    )
    p.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="accept new policy weights from a trainer (POST /weights/*; refused otherwise)",
    )
    p.add_argument(
        "--prompt-seed", type=int, default=None, help="seed unseeded requests per prompt (reproducible runs)"
    )
    p.add_argument("--allowed-local-root", action="append", default=[], help="media: allowed file:// root")
    p.add_argument("--allowed-http-host", action="append", default=[], help="media: allowed http(s) host")
    p.set_defaults(func=_cmd_serve)


def build_generator(args: argparse.Namespace) -> Any:
    """The generator the arguments name."""
    reasoning = not args.no_reasoning_parser
    if args.tiny and args.backend != "hf":
        from gymbridge.errors import ConfigError

        raise ConfigError(["--tiny is the transformers model: it runs on --backend hf only"])
    if args.tiny:
        from gymbridge.generation.hf import HFGenerator

        return HFGenerator.tiny(args.seed, max_model_len=args.max_model_len, reasoning_parser=reasoning)
    if args.backend == "vllm":
        from gymbridge.generation.vllm import VLLMGenerator

        return VLLMGenerator(args.model, max_model_len=args.max_model_len, reasoning_parser=reasoning)
    from gymbridge.generation.hf import HFGenerator

    return HFGenerator.from_pretrained(
        args.model, max_model_len=args.max_model_len, reasoning_parser=reasoning
    )


def weight_sink_for(generator: Any) -> Any:
    """The :class:`~gymbridge.generation.weights.WeightSink` that loads weights into ``generator``."""
    from gymbridge.generation.hf import HFGenerator

    if isinstance(generator, HFGenerator):
        from gymbridge.generation.weights import WeightReceiver

        return WeightReceiver(generator)
    from gymbridge.generation.vllm import VLLMWeightSink

    return VLLMWeightSink(generator)


async def _serve(args: argparse.Namespace) -> None:
    from gymbridge.generation.server import ModelServer, ModelServerConfig
    from gymbridge.media import MediaPolicy

    generator = build_generator(args)
    config = ModelServerConfig(
        model_name=str(getattr(generator, "model_name", args.model or "gymbridge-model")),
        max_model_len=int(generator.max_model_len),
        default_max_tokens=args.default_max_tokens,
        reasoning_parser=not args.no_reasoning_parser,
        max_batch_size=args.max_batch_size,
    )
    policy = MediaPolicy(
        allowed_local_roots=tuple(Path(r) for r in args.allowed_local_root),
        allowed_http_hosts=tuple(args.allowed_http_host),
    )
    sink: Any = None
    if args.enable_weight_updates:
        sink = weight_sink_for(generator)
    served: Any = generator
    if args.prompt_seed is not None:
        from gymbridge.bridge.shaping import PromptSeededGenerator

        served = PromptSeededGenerator(generator, args.prompt_seed)
    server = ModelServer(served, config=config, media_policy=policy, weight_sink=sink)
    url = await server.start(args.host, args.port)
    print(f"serving on {url} (OpenAI base URL {url}/v1)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def _cmd_serve(args: argparse.Namespace) -> int:
    asyncio.run(_serve(args))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry: ``python -m gymbridge.generation.cli serve ...``."""
    from gymbridge.cli import run_command

    parser = argparse.ArgumentParser(prog="gymbridge model")
    add_model_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run_command(args, prog="gymbridge model", log_level="INFO")


if __name__ == "__main__":
    sys.exit(main())
