"""Weight sync to a model server in another process: ``gymbridge model serve --enable-weight-updates``.

One child process (the tiny model, seed 0) serves the module's tests; a trainer-side model is
nudged, published over the gloo weight group or through shared memory (the ``publisher``
fixture runs each test with both transports, one after the other against the same child),
and the child's greedy generations must then be those of the nudged weights, stamped with the
published version.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.errors import GeneratorProcessError, WeightSyncError
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.server import WEIGHTS_SECRET_ENV, ModelServer, ModelServerConfig
from gymbridge.generation.types import SamplingConfig
from gymbridge.generation.weights import plan_buckets
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.run.generator_process import (
    ModelServerProcess,
    start_model_server_process,
    tiny_server_command,
)
from gymbridge.trainer.models import tiny_policy
from gymbridge.trainer.weight_sync import DistributedPublisher
from gymbridge.trajectory.types import GenerationInput

pytestmark = pytest.mark.integration

SECRET = secrets.token_urlsafe(32)
"""The child's run secret (its environment), which every weight call presents."""
AUTH = {"Authorization": f"Bearer {SECRET}"}


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelServerProcess]:
    cmd = tiny_server_command(
        seed=0, max_model_len=512, default_max_tokens=6, prompt_seed=None, enable_weight_updates=True
    )
    log = tmp_path_factory.mktemp("ms") / "model_server.log"
    with start_model_server_process(
        cmd, log_path=log, startup_timeout_s=120, env={WEIGHTS_SECRET_ENV: SECRET}
    ) as proc:
        yield proc


@pytest.fixture(scope="module", params=["broadcast", "shared_memory"])
def publisher(child: ModelServerProcess, request: pytest.FixtureRequest) -> Iterator[DistributedPublisher]:
    pub = DistributedPublisher(
        child.url, bucket_bytes=256 * 1024, timeout_s=60, transport=request.param, secret=SECRET
    )  # several buckets
    try:
        yield pub
    finally:
        pub.close()


def server_version(child: ModelServerProcess) -> int:
    version: int = httpx.get(f"{child.url}/weights/status", headers=AUTH).json()["policy_version"]
    return version


def nudged(seed: int) -> torch.nn.Module:
    model = tiny_policy(0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return model


def ask(url: str, text: str) -> dict[str, Any]:
    body = {"input": text, "temperature": 0.0, "max_output_tokens": 6}
    reply = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    last: dict[str, Any] = reply.json()["output"][-1]
    return last


async def local_greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    gen = HFGenerator(model, build_tiny_vlm(0).processor, max_model_len=512)
    (out,) = await gen.generate([GenerationInput(prompt_token_ids=prompt)], SamplingConfig(0.0, max_tokens=6))
    return out.token_ids, out.logprobs


def test_published_weights_are_the_ones_the_child_generates_with(
    child: ModelServerProcess, publisher: DistributedPublisher
) -> None:
    loaded = server_version(child)  # the child starts at version 0 (the same seed's weights)
    assert ask(child.url, "describe the picture")["policy_version"] == loaded
    model = nudged(1)
    seconds = publisher.publish(model, loaded + 1)
    assert publisher.transport == publisher.requested_transport
    assert seconds > 0.0  # the measured publication, not a budget
    after = ask(child.url, "describe the picture")
    assert after["policy_version"] == loaded + 1
    tokens, logprobs = asyncio.run(local_greedy(model, after["prompt_token_ids"]))
    assert after["generation_token_ids"] == tokens
    assert max(abs(a - b) for a, b in zip(after["generation_log_probs"], logprobs, strict=True)) < 1e-5
    status = httpx.get(f"{child.url}/weights/status", headers=AUTH).json()
    assert status["policy_version"] == loaded + 1 and status["error"] is None
    assert status["transport"] == publisher.transport


def test_several_buckets_and_versions_in_a_row(
    child: ModelServerProcess, publisher: DistributedPublisher
) -> None:
    assert len(plan_buckets(list(nudged(2).state_dict().items()), publisher.bucket_bytes)) > 3
    start = server_version(child) + 1
    for v in range(start, start + 3):  # shared memory: both segments, then the first one again
        model = nudged(v)
        publisher.publish(model, v)
        after = ask(child.url, "hi")
        assert after["policy_version"] == v
        tokens, logprobs = asyncio.run(local_greedy(model, after["prompt_token_ids"]))
        assert after["generation_token_ids"] == tokens
        assert max(abs(a - b) for a, b in zip(after["generation_log_probs"], logprobs, strict=True)) < 1e-5


def test_an_older_version_is_refused(child: ModelServerProcess, publisher: DistributedPublisher) -> None:
    publisher.publish(nudged(3), server_version(child) + 1)
    with pytest.raises(WeightSyncError, match="older"):
        publisher.publish(nudged(3), 0)


def test_a_model_of_another_layout_is_refused_before_anything_moves(child: ModelServerProcess) -> None:
    before = httpx.get(f"{child.url}/weights/status", headers=AUTH).json()["policy_version"]
    other = DistributedPublisher(child.url, timeout_s=10, secret=SECRET)
    try:
        with pytest.raises(WeightSyncError, match=r"400.*do not match"):
            other.publish(torch.nn.Linear(4, 4), before + 1)
    finally:
        other.close()
    assert httpx.get(f"{child.url}/weights/status", headers=AUTH).json()["policy_version"] == before


async def test_weight_routes_are_refused_unless_enabled(tiny_gen: HFGenerator) -> None:
    config = ModelServerConfig(model_name="tiny", max_model_len=512, batching=False)
    async with ModelServer(tiny_gen, config=config) as server, httpx.AsyncClient() as client:
        for method, path in (
            ("GET", "/weights/status"),
            ("POST", "/weights/init_group"),
            ("POST", "/weights/update"),
        ):
            reply = await client.request(method, f"{server.url}{path}", json={})
            assert reply.status_code == 403, (path, reply.text)
            assert "--enable-weight-updates" in reply.json()["message"]


def test_the_child_is_gone_after_an_exception(tmp_path: Path) -> None:
    cmd = tiny_server_command(
        seed=0, max_model_len=256, default_max_tokens=4, prompt_seed=None, enable_weight_updates=False
    )
    pids: list[int] = []

    def fail_while_serving() -> None:
        with start_model_server_process(cmd, log_path=tmp_path / "ms.log") as proc:
            pids.append(proc.pid)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_while_serving()
    (pid,) = pids
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # neither the child nor anything in its process group survives


def test_a_child_that_exits_before_serving_is_reported_with_its_log(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import sys; print('no model here', file=sys.stderr); sys.exit(3)"]
    with pytest.raises(GeneratorProcessError, match=r"exited with 3(.|\n)*no model here"):
        start_model_server_process(cmd, log_path=tmp_path / "ms.log", startup_timeout_s=30)


@given(
    st.lists(
        st.tuples(st.integers(0, 300), st.sampled_from([torch.float32, torch.bfloat16, torch.int64])),
        max_size=30,
    ),
    st.integers(1, 2048),
    st.none() | st.integers(1, 4096),
)
def test_buckets_are_bounded_single_dtype_and_cover_every_entry_once(
    entries: list[tuple[int, torch.dtype]], bucket_bytes: int, alone_bytes: int | None
) -> None:
    named = [(f"w{i}", torch.zeros(n, dtype=d)) for i, (n, d) in enumerate(entries)]
    buckets = plan_buckets(named, bucket_bytes, alone_bytes=alone_bytes)
    sizes = {name: t.numel() * t.element_size() for name, t in named}
    seen = [s.name for b in buckets for s in b.specs]
    assert sorted(seen) == sorted(sizes)
    for b in buckets:
        assert {s.dtype for s in b.specs} == {b.dtype}
        total = sum(sizes[s.name] for s in b.specs)
        assert total <= bucket_bytes or len(b.specs) == 1
        if alone_bytes is not None and len(b.specs) > 1:  # entries that large travel alone
            assert all(sizes[s.name] < alone_bytes for s in b.specs)
    for dtype in {b.dtype for b in buckets}:  # state-dict order kept within a dtype
        order = [s.name for b in buckets if b.dtype == dtype for s in b.specs]
        assert order == sorted(order, key=lambda name: int(name[1:]))


def test_publishing_leaves_the_trainers_own_default_group_alone(
    child: ModelServerProcess, publisher: DistributedPublisher, tmp_path: Path
) -> None:
    """A trainer already in a data-parallel group (torch's default group) still publishes:
    the weight group is private and the default group is untouched."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'dp_store'}", rank=0, world_size=1)
    try:
        default = dist.group.WORLD
        publisher.publish(nudged(4), server_version(child) + 1)
        assert dist.group.WORLD is default and dist.get_world_size() == 1
        tensor = torch.ones(2)
        dist.all_reduce(tensor)  # the DP group still works
        assert tensor.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
    assert ask(child.url, "hi")["policy_version"] == publisher.version


def test_a_server_that_cannot_join_is_reported_at_once_not_after_the_timeout() -> None:
    """The server's join fails (here: its store is unreachable); the trainer hears of it through
    /weights/status within about a second instead of waiting out its join timeout."""
    import time

    from gymbridge.generation.weights import WeightReceiver
    from gymbridge.testing.model_server import TESTING_WEIGHTS_SECRET, served_in_thread

    gen = HFGenerator(tiny_policy(0), build_tiny_vlm(0).processor, max_model_len=256)
    receiver = WeightReceiver(gen)

    def unreachable(*args: Any) -> None:
        raise WeightSyncError("could not reach the weight store at 127.0.0.1:1")

    receiver._join = unreachable  # type: ignore[method-assign]
    with served_in_thread(gen, receiver, timeout_s=30) as url:
        # the slow path: waiting out the join
        publisher = DistributedPublisher(
            url, timeout_s=300, transport="broadcast", secret=TESTING_WEIGHTS_SECRET
        )
        started = time.monotonic()
        try:
            with pytest.raises(WeightSyncError, match=r"could not join the weight group.*127\.0\.0\.1:1"):
                publisher.publish(tiny_policy(0), 0)
        finally:
            publisher.close()
    assert time.monotonic() - started < 30  # wallclock-ok: reported, not the 300 s join timeout waited out
