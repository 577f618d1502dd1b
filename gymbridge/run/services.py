"""The servers a run starts on loopback, and the rollout source over them.

:func:`start_services` starts, on 127.0.0.1 free ports and in this order: the environment server
(unless agents of the user's own hold it, ``env.agent_url`` / ``env.head_url``; with ``env.mix``
one per environment), the media server (``rollout.media_by_reference``), the generator
(:func:`~gymbridge.run.placement.start_generator`: in process, or ``gymbridge model serve`` as a
child process) and, on the Gym path, gymbridge's :class:`~gymbridge.server.SimpleAgent` between
each environment and the model server. It returns the :class:`~gymbridge.bridge.RolloutSource`
the bridge draws from: :class:`~gymbridge.bridge.GymRollouts` (``POST /run`` through a
:class:`~gymbridge.client.GymClient`: one agent, the agents of a mix by label, or a head server's
by each row's ``agent_ref``) or :class:`~gymbridge.bridge.NativeRollouts`
(:func:`~gymbridge.rollout.run_episode` in this process; a mix's behind a
:class:`~gymbridge.bridge.sources.RoutedRollouts`).

Invariant: every resource is registered on the caller's exit stack the moment it exists, so the
servers, the child process and the clients are stopped whatever happens (success, error, Ctrl-C).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gymbridge.bridge import RolloutSource
    from gymbridge.metrics import PayloadMeter
    from gymbridge.run.config import RunConfig
    from gymbridge.run.model import RunModel
    from gymbridge.run.placement import GeneratorHandle
    from gymbridge.run.timing import StepCounters

__all__ = ["Services", "start_services"]


@dataclass
class Services:
    """What :func:`start_services` started."""

    source: RolloutSource
    generator: GeneratorHandle
    urls: dict[str, str] = field(default_factory=dict)
    media_hosts: tuple[str, ...] = ()
    """``host:port`` of the run's media store (media by reference), trusted by bridge and model server."""
    notes: list[str] = field(default_factory=list)
    """Lines for the console (what is on, what was left off and why)."""
    agent: Any | None = None
    """The run's own :class:`~gymbridge.server.SimpleAgent` (``None``: native path, or the user's agent)."""

    def step_counters(self) -> StepCounters:
        """The model server's and the agent's counters for each step's split (:mod:`gymbridge.run.timing`):
        read in process where they run here, over ``GET /counters`` where they do not."""
        from gymbridge.run.timing import CounterSource, StepCounters

        handle = self.generator
        model = None
        if handle.server is not None:
            model = CounterSource("model server", local=handle.server.counters)
        elif handle.model_url is not None:
            model = CounterSource("model server", url=handle.model_url)
        agent = None
        if self.agent is not None:
            agent = CounterSource("agent", local=self.agent.counters)
        elif "agent" in self.urls:
            agent = CounterSource("agent", url=self.urls["agent"])
        return StepCounters(model, agent)


def _policy_in_dtype(
    factory: Callable[[int], Any], dtype: torch.dtype, seed: int, lora: dict[str, Any] | None = None
) -> Any:
    """``factory(seed)`` cast to ``dtype`` (the in-process generator's model, in the trainer's dtype),
    with the trainer's LoRA adapters injected when ``lora`` (:func:`gymbridge.trainer.lora.lora_settings`)."""
    model = factory(seed)
    if lora is not None:
        from gymbridge.generation.lora import apply_lora

        apply_lora(model, lora)
    return model.to(dtype)


def _serve_flags(flags: str | tuple[str, ...], lora_rank: int) -> str | tuple[str, ...]:
    """The model server's flags, with vLLM's LoRA engine switched on for a LoRA trainer's adapters
    (an HF server injects them itself when the trainer opens its weight group)."""
    given = (flags,) if isinstance(flags, str) else tuple(flags)
    if lora_rank == 0 or "vllm" not in given:
        return flags
    # vLLM 0.33 takes these maximum ranks only (its LoRAConfig.max_lora_rank): the next one up
    cap = next((r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= lora_rank), lora_rank)
    return (*given, "--enable-lora", "--max-lora-rank", str(cap))


def _forced_tokens(text: str | None, generator: Any) -> list[int] | None:
    """``text`` as the generator's tokens plus its end of turn (``rollout.force_first_call``)."""
    if text is None:
        return None
    ids = [int(t) for t in generator.tokenizer(text, add_special_tokens=False)["input_ids"]]
    return [*ids, generator.codec.end_of_turn_id]


async def start_services(
    cfg: RunConfig,
    stack: contextlib.AsyncExitStack,
    *,
    model: RunModel,
    spec: Any,
    max_turns: int,
    run_path: Path,
    meter: PayloadMeter,
) -> Services:
    """Start what ``cfg`` needs (module docstring); everything is stopped by ``stack``.

    ``spec`` an :class:`~gymbridge.run.userenv.EnvMix`: each environment's server (and agent) is
    started under its label, each with its own turns (``rollout.max_turns``, else its own) and style.
    """
    from gymbridge.generation.lora import lora_settings
    from gymbridge.run.placement import start_generator
    from gymbridge.run.userenv import EnvMix
    from gymbridge.server import start_server

    urls: dict[str, str] = {}
    notes: list[str] = []
    envs = _envs_of(cfg, spec, max_turns)
    env_urls: dict[str, str] = {}
    for env in envs:
        running = await start_server(env.spec.make_server())
        stack.push_async_callback(running.stop)
        env_urls[env.label] = running.url
        urls["environment" if not isinstance(spec, EnvMix) else f"environment {env.label}"] = running.url
    native = cfg.rollout.native
    media_server = None
    if cfg.rollout.media_by_reference and native:
        notes.append("media by reference: off on the native path (no Gym request to shrink)")
    elif cfg.rollout.media_by_reference:
        from gymbridge.media import MediaServer, MediaStore

        media_server = MediaServer(MediaStore(run_path / "media_store"))
        media_server.start()
        stack.callback(media_server.stop)
        urls["media"] = media_server.base_url
        meter.media_size = media_server.store.size
    media_hosts = (media_server.host_entry,) if media_server is not None else ()
    handle = await start_generator(
        cfg.generator,
        stack,
        serve=not native,
        model_seed=cfg.model.seed,
        processor=model.processor,
        max_model_len=cfg.model.max_model_len,
        default_max_tokens=cfg.rollout.max_tokens,
        prompt_seed=cfg.seed if cfg.rollout.reproducible and not native else None,
        model_name=model.name,
        policy_factory=functools.partial(
            _policy_in_dtype, model.policy_factory, cfg.trainer.torch_dtype, lora=lora_settings(model.policy)
        ),
        serve_flag=_serve_flags(model.serve_flag, cfg.trainer.lora.rank),
        suppress_token_ids=cfg.trainer.suppress_token_ids,
        log_dir=run_path,
        port=cfg.generator.port,
        media_hosts=media_hosts,
    )
    source: Any
    agent: Any = None
    if native:
        from gymbridge.bridge import NativeRollouts

        assert handle.generator is not None  # native runs keep the generator in this process
        generator: Any = handle.generator
        if len(envs) > 1:  # one batching front for every environment: their model calls share batches
            from gymbridge.generation.batching import BatchingGenerator, needs_batching

            if needs_batching(generator):
                generator = BatchingGenerator(generator)
                stack.push_async_callback(generator.aclose)
        routes = {
            env.label: NativeRollouts(
                generator,
                env_urls[env.label],
                max_turns=env.max_turns,
                timeout_s=cfg.rollout.deadline_s,
                meter=meter,
                seed=cfg.seed if cfg.rollout.reproducible else None,
                # the env's declared style, not a guess from the row (a tool env may offer no tools)
                mode="gymnasium" if env.spec.style == "gymnasium" else "tools",
                withhold_token_ids=(
                    handle.generator.suppressed_token_ids if cfg.rollout.withhold_later_media else None
                ),
                forced_first_call=_forced_tokens(cfg.rollout.force_first_call, handle.generator),
            )
            for env in envs
        }
        if isinstance(spec, EnvMix):
            from gymbridge.bridge.sources import RoutedRollouts

            source = RoutedRollouts(routes)
        else:
            (source,) = routes.values()
        if cfg.rollout.force_first_call is not None:
            notes.append(
                f"force_first_call: every rollout's first model call is {cfg.rollout.force_first_call!r}"
            )
        if cfg.rollout.withhold_later_media:
            notes.append(
                "withhold_later_media: the generator does not see media that arrive after the first "
                "model call (the stale-prompt control); the trained turns keep them"
            )
    else:
        from gymbridge.bridge import GymRollouts
        from gymbridge.client import GymClient
        from gymbridge.metrics import PhaseTimer
        from gymbridge.server import SimpleAgent

        model_url = str(handle.model_url)
        agent_urls: dict[str, str] = {}
        shared = (
            PhaseTimer() if len(envs) > 1 else None
        )  # the agents' phases, counted once where they overlap
        for env in envs:
            one = SimpleAgent(
                resources_url=env_urls[env.label],
                model_url=model_url,
                gymnasium=env.spec.style == "gymnasium",
                max_steps=env.max_turns,
                model_timeout_s=cfg.rollout.deadline_s,
                media_store_url=media_server.base_url if media_server is not None else None,
                meter=meter,
            )
            if shared is not None:
                one.timings = shared
            agent = agent if agent is not None else one  # its counters: every agent's (shared)
            agent_running = await start_server(one)
            stack.push_async_callback(agent_running.stop)
            agent_urls[env.label] = agent_running.url
        if isinstance(spec, EnvMix):
            client = GymClient(agents=agent_urls, deadline_s=cfg.rollout.deadline_s)
        elif cfg.env.head_url is not None:
            client = GymClient(head_url=cfg.env.head_url, deadline_s=cfg.rollout.deadline_s)
        else:
            agent_url = next(iter(agent_urls.values()), cfg.env.agent_url)
            assert agent_url is not None
            client = GymClient(agent_url, deadline_s=cfg.rollout.deadline_s)
        stack.push_async_callback(client.aclose)
        urls["model"] = model_url
        if isinstance(spec, EnvMix):
            urls.update({f"agent {label}": url for label, url in agent_urls.items()})
        elif cfg.env.head_url is not None:  # read before any row: a wrong URL fails the start
            notes.append(await _head_agents(client, cfg.env.head_url))
            notes.append(
                "agent counters: not read from a head server's agents (their environment phases are "
                "counted in timing/wait_rollouts)"
            )
            urls["head"] = cfg.env.head_url
        else:
            urls["agent"] = str(client.agent_url)
        referencer = None
        if media_server is not None:
            from gymbridge.bridge import RowReferencer

            referencer = RowReferencer(media_server.store, media_server.url_for)
        source = GymRollouts(client, deadline_s=cfg.rollout.deadline_s, meter=meter, referencer=referencer)
        if handle.fleet is not None:  # below the fleet's floor the run stops, not prompt by prompt
            from gymbridge.run.fleet import FleetGuardedSource

            source = FleetGuardedSource(source, handle.fleet)
    stack.push_async_callback(source.aclose)
    return Services(source, handle, urls, media_hosts, notes, agent=agent)


@dataclass(frozen=True)
class _Env:
    """One environment the run starts: its label, spec and turns per episode."""

    label: str
    spec: Any
    max_turns: int


def _envs_of(cfg: RunConfig, spec: Any, max_turns: int) -> list[_Env]:
    """The environments to start: a mix's (each with its own turns unless ``rollout.max_turns``),
    the one of ``spec``, or none (agents of the user's own)."""
    from gymbridge.run.userenv import EnvMix

    if spec is None:
        return []
    if not isinstance(spec, EnvMix):
        return [_Env(str(getattr(spec, "name", "environment")), spec, max_turns)]
    turns = cfg.rollout.max_turns
    return [_Env(e.label, e.spec, turns if turns is not None else int(e.spec.max_turns)) for e in spec.envs]


async def _head_agents(client: Any, head_url: str) -> str:
    """The head server's agents, as a line for the console; :class:`ConfigError` when it lists none
    or cannot be read (before any row is sent)."""
    from gymbridge.errors import ConfigError, GymbridgeError

    try:
        agents = await client.discover()
    except GymbridgeError as exc:
        raise ConfigError(
            [f"env.head_url: cannot read the head server's agents at {head_url}: {exc}"]
        ) from exc
    if not agents:
        raise ConfigError(
            [f"env.head_url: the head server at {head_url} lists no agent (responses_api_agents)"]
        )
    return f"head server {head_url}: {len(agents)} agent(s): " + ", ".join(
        f"{name} {url}" for name, url in sorted(agents.items())
    )
