"""Where the launcher's generator runs, and how it gets the trainer's weights (``generator:``).

:func:`start_generator` sets up the generator a launcher samples from and returns a
:class:`GeneratorHandle` whose :meth:`~GeneratorHandle.publish` the launcher calls after
every optimizer step:

* ``placement: in_process`` — an :class:`~gymbridge.generation.hf.HFGenerator` over a model
  object **of its own** (same seed, same weights as the trainer's policy at step 0; never the
  trainer's object, so an optimizer step can never change the weights under a running
  generation), served by an in-process model server on the Gym path; weights are copied in
  by :class:`~gymbridge.trainer.weight_sync.InProcessPublisher`;
* ``placement: process`` — ``gymbridge model serve --tiny --enable-weight-updates`` as a
  child process (:mod:`gymbridge.run.generator_process`), weights published by
  :class:`~gymbridge.trainer.weight_sync.DistributedPublisher` through shared memory or a
  torch.distributed broadcast (``weight_transport``). The Gym path only: native rollouts call
  a generator object in this process. With ``replicas > 1``: that many children behind a router
  this process owns, restarted when they die (:mod:`gymbridge.run.fleet`); the vLLM engine
  arguments (``tensor_parallel_size``, ...) reach every child as flags.

``publish_weights: false`` leaves the generator at the step-0 weights, to show what a missing
weight sync does (the trainer's drift guard fails the run). ``tool_parser`` (the tool-call format)
reaches either generator's chat codec (the child's as ``--tool-parser``). ``suppress_token_ids``
(the trainer's ``trainer.suppress_token_ids``) reaches either generator, so it samples from the
distribution the trainer scores: temperature and top-p travel with every request (the dataset rows
carry the trainer's), the mask is the generator's own. Every resource is registered on the
caller's exit stack as soon as it exists, so the child process and the servers are stopped
whatever happens.

Each :func:`start_generator` makes a run secret (``secrets.token_urlsafe(32)``): the model server's
``/weights/*`` routes answer only a caller that presents it. The child gets it in its environment
(``GYMBRIDGE_WEIGHTS_SECRET``), the in-process server through its constructor, the publisher as its
``secret``; it is never on a command line, in a log line, in the config or in the run directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from gymbridge.config import StrictModel
from gymbridge.errors import ConfigError
from gymbridge.generation.tool_calls import ToolParserName

logger = logging.getLogger(__name__)

__all__ = ["GeneratorConfig", "GeneratorHandle", "start_generator"]


class GeneratorConfig(StrictModel):
    """The ``generator:`` section of a run config."""

    placement: Literal["in_process", "process"] = "in_process"
    """``in_process``: a generator with its own model copy in the launcher's process;
    ``process``: ``gymbridge model serve`` as a child process, weights over torch.distributed."""
    publish_weights: bool = True
    """Publish the trainer's weights after every optimizer step. ``false`` leaves the generator
    at the step-0 weights (what a forgotten weight sync looks like: the drift guard fails)."""
    bucket_mb: int = Field(64, ge=1)
    """Largest flat buffer of one broadcast, MiB (``process``)."""
    weight_transport: Literal["auto", "broadcast", "shared_memory"] = "auto"
    """How the weights reach the child (``process``): ``shared_memory`` (two ``/dev/shm`` segments,
    one copy, no socket; this host, CPU models), ``broadcast`` (torch.distributed), or ``auto``:
    shared memory when the child is on this host and it can be set up, else the broadcast
    (:mod:`gymbridge.trainer.weight_sync`)."""
    sync_timeout_s: float = Field(120.0, gt=0)
    """Bound on joining the weight group, each broadcast and each control call (``process``)."""
    startup_timeout_s: float = Field(180.0, gt=0)
    """How long the child model server may take to print its ``serving on`` line (``process``)."""
    port: int = Field(0, ge=0, le=65535)
    """The model server's port (0: a free one); an agent of your own (``env.agent_url``) calls it there."""
    tool_parser: ToolParserName = "auto"
    """The tool-call format generations are parsed in: ``hermes`` (``<tool_call>{json}</tool_call>``),
    ``qwen3_coder`` (``<tool_call><function=NAME><parameter=P>...``, Qwen3-Coder / Qwen3.5), or
    ``auto``: the one the model's chat template writes (:mod:`gymbridge.generation.tool_calls`)."""
    replicas: int = Field(1, ge=1)
    """Model servers of the fleet (``process`` only): more than 1 starts that many children behind a
    router this process owns (:mod:`gymbridge.run.fleet`, docs/placement.md "Fleet"); 1: one child."""
    min_healthy: int = Field(1, ge=1)
    """The fleet's floor: fewer replicas holding the current weights than this stops the run
    (:class:`~gymbridge.errors.GeneratorFleetError`)."""
    max_restarts: int = Field(5, ge=0)
    """Restarts of one replica over the run (with a doubling back-off) before it stays DEAD."""
    restart_backoff_s: float = Field(1.0, ge=0)
    """Wait before a replica's first restart; doubled for each further one (at most 30 s)."""
    devices_per_replica: int | None = Field(None, ge=0)
    """GPUs each replica sees (its own ``CUDA_VISIBLE_DEVICES``, taken in order from ``devices``).
    ``None``: with ``model.backend: vllm`` and GPUs visible ``tensor_parallel_size`` each, else the
    environment left alone; 0: the environment left alone."""
    devices: list[int] | None = None
    """The GPU ids the replicas take theirs from (default: every visible one, in order)."""
    tensor_parallel_size: int | None = Field(None, ge=1)
    """vLLM engine argument of each model server (``model.backend: vllm``; ``None``: vLLM's default)."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """vLLM engine argument: the share of each replica's GPU memory vLLM takes."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = None
    """vLLM engine argument: the weights' and activations' dtype."""
    max_num_seqs: int | None = Field(None, ge=1)
    """vLLM engine argument: sequences in one engine step."""

    @model_validator(mode="after")
    def _fleet_needs_processes(self) -> GeneratorConfig:
        if self.replicas > 1 and self.placement != "process":
            raise ValueError(
                f"generator.replicas={self.replicas} needs generator.placement=process (each replica is a "
                "model server process of its own; in_process has one generator in the launcher)"
            )
        if self.min_healthy > self.replicas:
            raise ValueError(
                f"generator.min_healthy={self.min_healthy} is more than generator.replicas={self.replicas}"
            )
        return self

    def vllm_flags(self) -> list[str]:
        """The vLLM engine arguments set here as ``gymbridge model serve`` flags."""
        flags: list[str] = []
        for name in ("tensor_parallel_size", "gpu_memory_utilization", "dtype", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None:
                flags += ["--" + name.replace("_", "-"), str(value)]
        return flags


@dataclass
class GeneratorHandle:
    """The launcher's view of its generator (see the module docstring)."""

    placement: str
    generator: Any | None
    """The in-process generator (``None`` with ``placement: process``)."""
    model_url: str | None
    """The model server's base URL (``None`` on the native path)."""
    publisher: Any | None
    """The :class:`~gymbridge.trainer.weight_sync.WeightPublisher` (``None``: publication off)."""
    pid: int | None = None
    """The child model server's pid (``placement: process``)."""
    version: int = -1
    """The last published policy version (-1: none yet)."""
    server: Any | None = None
    """The in-process :class:`~gymbridge.generation.server.ModelServer` (``None``: none in this process)."""
    fleet: Any | None = None
    """The :class:`~gymbridge.run.fleet.FleetManager` with ``generator.replicas > 1`` (``model_url`` is
    its router's)."""

    def publish(self, model: Any, version: int) -> float:
        """Publish ``model`` as ``version`` (when publication is on and it is new); returns seconds."""
        if self.publisher is None or version <= self.version:
            return 0.0
        seconds = float(self.publisher.publish(model, version))
        self.version = version
        return seconds


async def start_generator(
    cfg: GeneratorConfig,
    stack: contextlib.AsyncExitStack,
    *,
    serve: bool,
    model_seed: int,
    processor: Any,
    max_model_len: int,
    default_max_tokens: int,
    prompt_seed: int | None,
    model_name: str,
    log_dir: Path,
    policy_factory: Callable[[int], Any] | None = None,
    serve_flag: str | tuple[str, ...] = "--tiny",
    port: int = 0,
    media_hosts: tuple[str, ...] = (),
    suppress_token_ids: Sequence[int] | None = None,
) -> GeneratorHandle:
    """Set up the generator (and, with ``serve``, its model server); see the module docstring.

    ``policy_factory(model_seed)`` builds the in-process generator's own model (default: the tiny
    Qwen2-VL); ``serve_flag`` is the ``gymbridge model serve`` flag(s) of the same model for the child
    process (``--tiny``, ``--tiny-omni`` or ``("--model", PATH, "--backend", B)``); ``port`` is the
    model server's (0: a free one). ``media_hosts`` (``host:port`` of media stores) go into the
    model server's ``MediaPolicy``, so it fetches (and verifies) media references.
    ``suppress_token_ids``: ids never sampled on top of the model's media ids (``None``: those only).
    """
    extra_suppressed = tuple(int(t) for t in suppress_token_ids or ())
    weights_secret = secrets.token_urlsafe(32)  # this run's: only its trainer may change the weights
    if cfg.placement == "process":
        return await _start_process(
            cfg,
            stack,
            weights_secret=weights_secret,
            serve=serve,
            model_seed=model_seed,
            max_model_len=max_model_len,
            default_max_tokens=default_max_tokens,
            prompt_seed=prompt_seed,
            log_dir=log_dir,
            serve_flag=serve_flag,
            port=port,
            media_hosts=media_hosts,
            suppress_token_ids=extra_suppressed,
        )
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.trainer.models import tiny_policy
    from gymbridge.trainer.weight_sync import InProcessPublisher

    build = policy_factory if policy_factory is not None else tiny_policy
    generator = HFGenerator(
        build(model_seed),
        processor,
        max_model_len=max_model_len,
        model_name=model_name,
        suppress_token_ids=extra_suppressed,
        tool_parser=cfg.tool_parser,
    )
    publisher = InProcessPublisher(generator) if cfg.publish_weights else None
    url: str | None = None
    server = None
    if serve:
        from gymbridge.generation.seeding import PromptSeededGenerator
        from gymbridge.generation.server import ModelServer, ModelServerConfig
        from gymbridge.media import MediaPolicy

        server = ModelServer(
            PromptSeededGenerator(generator, prompt_seed) if prompt_seed is not None else generator,
            config=ModelServerConfig(
                model_name=model_name, max_model_len=max_model_len, default_max_tokens=default_max_tokens
            ),
            media_policy=MediaPolicy(media_hosts=media_hosts),
            weights_secret=weights_secret,
        )
        url = await server.start(port=port)
        stack.push_async_callback(server.stop)
    return GeneratorHandle("in_process", generator, url, publisher, server=server)


async def _start_process(
    cfg: GeneratorConfig,
    stack: contextlib.AsyncExitStack,
    *,
    weights_secret: str,
    serve: bool,
    model_seed: int,
    max_model_len: int,
    default_max_tokens: int,
    prompt_seed: int | None,
    log_dir: Path,
    serve_flag: str | tuple[str, ...],
    port: int,
    media_hosts: tuple[str, ...] = (),
    suppress_token_ids: tuple[int, ...] = (),
) -> GeneratorHandle:
    from gymbridge.generation.server import WEIGHTS_SECRET_ENV
    from gymbridge.run.generator_process import start_model_server_process, tiny_server_command
    from gymbridge.trainer.weight_sync import DistributedPublisher

    if not serve:
        raise ConfigError(
            [
                "generator.placement=process runs the model server in its own process: it needs the "
                "Gym path (native: false); native rollouts call a generator in this process"
            ]
        )
    command = tiny_server_command(
        seed=model_seed,
        max_model_len=max_model_len,
        default_max_tokens=default_max_tokens,
        prompt_seed=prompt_seed,
        enable_weight_updates=cfg.publish_weights,
        model_flag=serve_flag,
        port=0 if cfg.replicas > 1 else port,  # a fleet's replicas take free ports, its router `port`
        media_hosts=media_hosts,
        tool_parser=cfg.tool_parser,
    )
    for token_id in suppress_token_ids:
        command += ["--suppress-token-id", str(token_id)]
    command += _engine_flags(cfg, serve_flag)
    if cfg.replicas > 1:
        from gymbridge.run.fleet import start_fleet

        return await start_fleet(
            cfg, stack, command, weights_secret=weights_secret, log_dir=log_dir, port=port
        )
    child = await asyncio.to_thread(
        start_model_server_process,
        command,
        log_path=log_dir / "model_server.log",
        startup_timeout_s=cfg.startup_timeout_s,
        env={WEIGHTS_SECRET_ENV: weights_secret} if cfg.publish_weights else None,
    )
    stack.callback(child.stop)  # registered before anything else can fail
    publisher = None
    if cfg.publish_weights:
        publisher = DistributedPublisher(
            child.url,
            bucket_bytes=cfg.bucket_mb * 1024 * 1024,
            timeout_s=cfg.sync_timeout_s,
            transport=cfg.weight_transport,
            secret=weights_secret,
        )
        stack.callback(publisher.close)  # LIFO: the group closes before the child stops
    return GeneratorHandle("process", None, child.url, publisher, pid=child.pid)


def _engine_flags(cfg: GeneratorConfig, serve_flag: str | tuple[str, ...]) -> list[str]:
    """``generator``'s vLLM engine arguments as flags; set for another backend: :class:`ConfigError`."""
    flags = cfg.vllm_flags()
    if flags and "vllm" not in ((serve_flag,) if isinstance(serve_flag, str) else serve_flag):
        names = ", ".join(f.removeprefix("--").replace("-", "_") for f in flags[::2])
        raise ConfigError([f"generator.{names}: vLLM engine arguments, for model.backend=vllm only"])
    return flags
