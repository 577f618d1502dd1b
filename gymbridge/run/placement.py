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
  a generator object in this process.

``publish_weights: false`` leaves the generator at the step-0 weights, to show what a missing
weight sync does (the trainer's drift guard fails the run). ``tool_parser`` (the tool-call format)
reaches either generator's chat codec (the child's as ``--tool-parser``). ``suppress_token_ids``
(the trainer's ``trainer.suppress_token_ids``) reaches either generator, so it samples from the
distribution the trainer scores: temperature and top-p travel with every request (the dataset rows
carry the trainer's), the mask is the generator's own. Every resource is registered on the
caller's exit stack as soon as it exists, so the child process and the servers are stopped
whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

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
    if cfg.placement == "process":
        return await _start_process(
            cfg,
            stack,
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
        )
        url = await server.start(port=port)
        stack.push_async_callback(server.stop)
    return GeneratorHandle("in_process", generator, url, publisher, server=server)


async def _start_process(
    cfg: GeneratorConfig,
    stack: contextlib.AsyncExitStack,
    *,
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
        port=port,
        media_hosts=media_hosts,
        tool_parser=cfg.tool_parser,
    )
    for token_id in suppress_token_ids:
        command += ["--suppress-token-id", str(token_id)]
    child = await asyncio.to_thread(
        start_model_server_process,
        command,
        log_path=log_dir / "model_server.log",
        startup_timeout_s=cfg.startup_timeout_s,
    )
    stack.callback(child.stop)  # registered before anything else can fail
    publisher = None
    if cfg.publish_weights:
        publisher = DistributedPublisher(
            child.url,
            bucket_bytes=cfg.bucket_mb * 1024 * 1024,
            timeout_s=cfg.sync_timeout_s,
            transport=cfg.weight_transport,
        )
        stack.callback(publisher.close)  # LIFO: the group closes before the child stops
    return GeneratorHandle("process", None, child.url, publisher, pid=child.pid)
