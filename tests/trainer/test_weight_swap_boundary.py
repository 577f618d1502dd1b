"""Pause at a generation boundary, swap, resume (:class:`~gymbridge.generation.weights.WeightGate`).

A publication never waits behind a running generate call: it lands in staging and returns; the
running call ends on the old weights and reports the old version; a call started after the
publication runs on the new version, exactly the published weights; no generation sees two
versions. Each path: :class:`InProcessPublisher`, and :class:`DistributedPublisher` to a model
server with a :class:`WeightReceiver` over the broadcast and over shared memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import torch

from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.server import ModelServer, ModelServerConfig
from gymbridge.generation.shared_weights import SHM_DIR
from gymbridge.generation.types import Generation, SamplingConfig
from gymbridge.generation.weights import WeightReceiver, named_weights
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.trainer.models import tiny_policy
from gymbridge.trainer.weight_sync import DistributedPublisher, InProcessPublisher, WeightTransport
from gymbridge.trajectory.types import GenerationInput

SECRET = secrets.token_urlsafe(32)
NEEDS_SHM = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)")
PATHS = [
    "in_process",
    pytest.param("broadcast", marks=pytest.mark.integration),
    pytest.param("shared_memory", marks=[pytest.mark.integration, NEEDS_SHM]),
]
HANG_GUARD_S = 60.0
"""How long a test waits for something that takes well under a second (a hang guard only)."""


def marker_name(model: torch.nn.Module) -> str:
    """A published floating matrix whose element ``[0, 0]`` carries the version (the marker)."""
    return next(n for n, t in named_weights(model) if t.is_floating_point() and t.dim() == 2)


def trainer_at(version: int) -> torch.nn.Module:
    """The trainer's weights of ``version``: nudged by it, with its marker set to it."""
    model = tiny_policy(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * version)
        model.state_dict()[marker_name(model)][0, 0] = float(version)
    return model


@dataclass
class Watch:
    """A forward pre-hook on the generator's model: every forward step records the live version and
    the marker it runs with (into the list of the generation under way); :meth:`hold` makes the
    next step block until :meth:`let_go` (a generate call as long as the test wants)."""

    gen: HFGenerator
    calls: list[list[tuple[int, float]]] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    step_sleep_s: float = 0.0
    _held: bool = False

    def __post_init__(self) -> None:
        self._marker = dict(self.gen.model.named_parameters())[marker_name(self.gen.model)]
        self._handle = self.gen.model.register_forward_pre_hook(self._step)

    def _step(self, _module: Any, _args: Any) -> None:
        if self.calls:
            self.calls[-1].append((self.gen.policy_version, float(self._marker.detach()[0, 0])))
        if self._held:
            self._held = False
            self.started.set()
            self.released.wait(HANG_GUARD_S)
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)

    def hold(self) -> None:
        self.started.clear()
        self.released.clear()
        self._held = True

    def let_go(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.let_go()
        self._handle.remove()


def generate(gen: HFGenerator, watch: Watch, max_tokens: int = 4) -> Generation:
    watch.calls.append([])
    inp = GenerationInput(prompt_token_ids=gen.codec.encode("describe the weights"))
    (out,) = asyncio.run(gen.generate([inp], SamplingConfig(temperature=0.0, max_tokens=max_tokens)))
    return out


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``work`` on a thread of its own; the list gets its result (or its exception)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as exc:  # handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@contextlib.contextmanager
def served(gen: HFGenerator, sink: WeightReceiver) -> Iterator[str]:
    """A model server with weight updates on (the run secret :data:`SECRET`), on a thread of its own."""
    ready = threading.Event()
    urls: list[str] = []
    errors: list[BaseException] = []
    stop: list[asyncio.Event] = []

    async def serve() -> None:
        try:
            server = ModelServer(
                gen, config=ModelServerConfig(batching=False), weight_sink=sink, weights_secret=SECRET
            )
            urls.append(await server.start())
        except BaseException as exc:
            errors.append(exc)
            ready.set()
            return
        stop.append(asyncio.Event())
        ready.set()
        await stop[0].wait()
        await server.stop()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    ready.wait(HANG_GUARD_S)
    if errors:
        raise errors[0]
    try:
        yield urls[0]
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(HANG_GUARD_S)


@dataclass
class Via:
    """One way to publish into ``gen``: ``publish(model, version)`` and the generator's live version
    as its publisher sees it (``/weights/status`` for a server)."""

    publish: Callable[[Any, int], float]
    live_version: Callable[[], int]


@contextlib.contextmanager
def publishing(path: str, gen: HFGenerator) -> Iterator[Via]:
    if path == "in_process":
        yield Via(InProcessPublisher(gen).publish, lambda: gen.policy_version)
        return
    receiver = WeightReceiver(gen)
    with served(gen, receiver) as url:
        transport = cast(WeightTransport, path)
        publisher = DistributedPublisher(url, transport=transport, timeout_s=HANG_GUARD_S, secret=SECRET)
        try:
            yield Via(publisher.publish, lambda: int(publisher.status()["policy_version"]))
            assert publisher.transport == path
        finally:
            publisher.close()
            receiver.close()


def assert_weights_are(gen: HFGenerator, trainer: torch.nn.Module) -> None:
    mine, theirs = gen.model.state_dict(), trainer.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), [
        k for k in mine if not torch.equal(mine[k], theirs[k])
    ]


@pytest.mark.parametrize("path", PATHS)
def test_regression_a_publish_does_not_wait_behind_a_long_generate(path: str) -> None:
    """The generator held its weights lock for a whole generate call and the receiver (and the
    in-process publisher) took it for the whole publication, so a publish (and the trainer's side
    of the broadcast, which every group member must enter) waited behind generation for up to
    ``generator.sync_timeout_s``. Here the generate call cannot end before the publish returns."""
    gen = HFGenerator(tiny_policy(0), build_tiny_vlm(0).processor, max_model_len=256)
    watch = Watch(gen)
    try:
        with publishing(path, gen) as via:
            via.publish(trainer_at(1), 1)  # idle: live at once (and the transport is set up)
            assert via.live_version() == 1
            watch.hold()
            running, running_out = in_thread(lambda: generate(gen, watch))
            assert watch.started.wait(HANG_GUARD_S), running_out
            new = trainer_at(2)
            publish, published = in_thread(lambda: via.publish(new, 2))
            publish.join(HANG_GUARD_S)
            assert not publish.is_alive(), "the publish waited for the running generate call"
            assert running.is_alive()
            assert not isinstance(published[0], BaseException), published[0]
            assert via.live_version() == 1  # the running call still has the old weights
            assert gen.weights_lock.pending_version == 2
            watch.let_go()
            running.join(HANG_GUARD_S)
            (old,) = running_out
            assert isinstance(old, Generation) and old.policy_version == 1
            assert set(watch.calls[0]) == {(1, 1.0)}  # every step of it on version 1's weights
            assert via.live_version() == 2 and gen.weights_lock.pending_version is None
            after = generate(gen, watch)
            assert after.policy_version == 2 and set(watch.calls[1]) == {(2, 2.0)}
            assert_weights_are(gen, new)
    finally:
        watch.close()


@pytest.mark.parametrize("path", PATHS)
def test_no_token_of_one_generation_comes_from_two_versions(path: str) -> None:
    """Publications land as fast as the trainer can make them while generations run back to back:
    each generation's every step runs on one version's weights, the one it reports."""
    gen = HFGenerator(tiny_policy(0), build_tiny_vlm(0).processor, max_model_len=256)
    watch = Watch(gen, step_sleep_s=0.002)
    done = threading.Event()
    try:
        with publishing(path, gen) as via:
            via.publish(trainer_at(1), 1)  # every generation runs on a marked version

            def keep_publishing() -> int:
                version = 1
                while not done.is_set():
                    version += 1
                    via.publish(trainer_at(version), version)
                return version

            publisher, last = in_thread(keep_publishing)
            gens = [generate(gen, watch, max_tokens=6) for _ in range(10)]
            done.set()
            publisher.join(HANG_GUARD_S)
            assert not publisher.is_alive() and not isinstance(last[0], BaseException), last
        for out, seen in zip(gens, watch.calls, strict=True):
            assert seen and set(seen) == {(out.policy_version, float(out.policy_version))}, seen
        assert len({g.policy_version for g in gens}) > 1  # publications did land between them
    finally:
        done.set()
        watch.close()


@NEEDS_SHM
@pytest.mark.integration
def test_a_shared_memory_write_waits_for_the_segment_a_running_generation_reads() -> None:
    """Two segments: version 2 goes to segment 1 while a generation runs on version 1 (segment 0);
    version 3 would go to segment 0, so its publish waits until version 2 is live, and the
    running generation never sees its weights change."""
    gen = HFGenerator(tiny_policy(0), build_tiny_vlm(0).processor, max_model_len=256)
    watch = Watch(gen, step_sleep_s=0.002)
    try:
        with publishing("shared_memory", gen) as via:
            via.publish(trainer_at(1), 1)
            watch.hold()
            running, running_out = in_thread(lambda: generate(gen, watch, max_tokens=6))
            assert watch.started.wait(HANG_GUARD_S), running_out
            via.publish(trainer_at(2), 2)  # segment 1: nobody reads it, no wait
            third, third_out = in_thread(lambda: via.publish(trainer_at(3), 3))
            third.join(0.5)
            assert third.is_alive(), "version 3 was written into the segment the generation reads"
            watch.let_go()
            running.join(HANG_GUARD_S)
            third.join(HANG_GUARD_S)
            assert not third.is_alive() and not isinstance(third_out[0], BaseException), third_out
            (old,) = running_out
            assert old.policy_version == 1 and set(watch.calls[0]) == {(1, 1.0)}
            assert via.live_version() == 3
            assert generate(gen, watch).policy_version == 3
            assert_weights_are(gen, trainer_at(3))
    finally:
        watch.close()
