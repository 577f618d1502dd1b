"""The servers a run starts on loopback, and the rollout source over them.

:func:`start_services` starts, on 127.0.0.1 free ports and in this order: the environment server
(unless an agent of the user's own holds it, ``env.agent_url``), the media server
(``rollout.media_by_reference``), the generator (:func:`~gymbridge.run.placement.start_generator`:
in process, or ``gymbridge model serve`` as a child process) and, on the Gym path, gymbridge's
:class:`~gymbridge.server.SimpleAgent` between environment and model server. It returns the
:class:`~gymbridge.bridge.RolloutSource` the bridge draws from: :class:`~gymbridge.bridge.GymRollouts`
(``POST /run`` through a :class:`~gymbridge.client.GymClient`) or
:class:`~gymbridge.bridge.NativeRollouts` (:func:`~gymbridge.rollout.run_episode` in this process).

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
    """Start what ``cfg`` needs (module docstring); everything is stopped by ``stack``."""
    from gymbridge.generation.lora import lora_settings
    from gymbridge.run.placement import start_generator
    from gymbridge.server import start_server

    urls: dict[str, str] = {}
    notes: list[str] = []
    env_url = ""
    if spec is not None:
        env = await start_server(spec.make_server())
        stack.push_async_callback(env.stop)
        urls["environment"] = env_url = env.url
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
        source = NativeRollouts(
            handle.generator,
            env_url,
            max_turns=max_turns,
            timeout_s=cfg.rollout.deadline_s,
            meter=meter,
            seed=cfg.seed if cfg.rollout.reproducible else None,
            # the env's declared style, not a guess from the row (a tool env may offer no tools)
            mode="gymnasium" if spec is not None and spec.style == "gymnasium" else "tools",
            withhold_token_ids=(
                handle.generator.suppressed_token_ids if cfg.rollout.withhold_later_media else None
            ),
            forced_first_call=_forced_tokens(cfg.rollout.force_first_call, handle.generator),
        )
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
        from gymbridge.server import SimpleAgent

        model_url = str(handle.model_url)
        agent_url = cfg.env.agent_url
        if spec is not None:
            agent = SimpleAgent(
                resources_url=env_url,
                model_url=model_url,
                gymnasium=spec.style == "gymnasium",
                max_steps=max_turns,
                model_timeout_s=cfg.rollout.deadline_s,
                media_store_url=media_server.base_url if media_server is not None else None,
                meter=meter,
            )
            agent_running = await start_server(agent)
            stack.push_async_callback(agent_running.stop)
            agent_url = agent_running.url
        assert agent_url is not None
        client = GymClient(agent_url, deadline_s=cfg.rollout.deadline_s)
        stack.push_async_callback(client.aclose)
        referencer = None
        if media_server is not None:
            from gymbridge.bridge import RowReferencer

            referencer = RowReferencer(media_server.store, media_server.url_for)
        source = GymRollouts(client, deadline_s=cfg.rollout.deadline_s, meter=meter, referencer=referencer)
        urls.update(model=model_url, agent=agent_url)
    stack.push_async_callback(source.aclose)
    return Services(source, handle, urls, media_hosts, notes, agent=agent)
