"""BridgeIterator over the native path: run_episode drives the tiny VLM against a real environment."""

from __future__ import annotations

import pytest

from gymbridge.bridge import BridgeConfig, BridgeIterator, BridgeStalledError, NativeRollouts
from gymbridge.generation.hf import HFGenerator
from gymbridge.server import free_port, start_server
from gymbridge.tensors import MediaProcessor

pytestmark = pytest.mark.integration


def _rows(n: int) -> list[dict[str, object]]:
    from gymbridge_envs import get_env

    rows = get_env("circle_click").generate(n, 3, img_size=112, radius_min=8, radius_max=14)
    return [
        {**r, "responses_create_params": {**r["responses_create_params"], "max_output_tokens": 4}}
        for r in rows
    ]


async def test_native_groups_carry_indices_and_share_one_image(processor: MediaProcessor) -> None:
    from gymbridge_envs import get_env

    gen = HFGenerator.tiny(0)
    async with await start_server(get_env("circle_click").make_server()) as env:
        source = NativeRollouts(gen, env.url, max_turns=1)
        try:
            it = BridgeIterator(
                _rows(2),
                source,
                processor,
                BridgeConfig(
                    group_size=3, prompts_per_step=2, min_group_size=None, max_consecutive_failed_groups=8
                ),
            )
            (batch,) = [b async for b in it]
        finally:
            await source.aclose()
    assert len(batch) == 6 and batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert [(m["task_index"], m["rollout_index"]) for m in batch.metadata] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)
    ]  # fmt: skip
    assert batch.media["pixel_values"].num_segments == 2 and batch.media["pixel_values"].num_refs == 6
    assert processor.stats.items_processed == 2
    assert it.stats.rollouts_ok == 6 and it.failures == []


async def test_native_environment_down_is_recorded_then_raises(processor: MediaProcessor) -> None:
    gen = HFGenerator.tiny(0)
    dead = f"http://127.0.0.1:{free_port()}"
    source = NativeRollouts(gen, dead, max_turns=1, timeout_s=2.0)
    try:
        it = BridgeIterator(
            _rows(5),
            source,
            processor,
            BridgeConfig(
                group_size=2, max_consecutive_failed_groups=2, prompts_per_step=1, min_group_size=None
            ),
        )
        with pytest.raises(BridgeStalledError, match="2 consecutive groups failed"):
            await it.__anext__()
    finally:
        await source.aclose()
    assert set(it.stats.failure_classes) == {"EnvTransportError"}
    assert it.stats.rollouts_failed == 4 and it.stats.groups_failed == 2


async def test_regression_seeded_native_rollout_with_a_bad_sampling_field_is_recorded(
    processor: MediaProcessor,
) -> None:
    """With ``seed`` set, ``NativeRollouts`` parsed the row's sampling fields itself: ``float("hot")``
    escaped as a bare ``ValueError`` and killed the whole iterator, where the unseeded path records
    a ``ProtocolError`` for the rollout. Both paths now validate the same way."""
    gen = HFGenerator.tiny(0)
    row = _rows(1)[0]
    bad = {**row, "responses_create_params": {**row["responses_create_params"], "temperature": "hot"}}
    source = NativeRollouts(gen, f"http://127.0.0.1:{free_port()}", max_turns=1, timeout_s=2.0, seed=7)
    try:
        it = BridgeIterator(
            [bad],
            source,
            processor,
            BridgeConfig(
                group_size=2, max_consecutive_failed_groups=1, prompts_per_step=1, min_group_size=None
            ),
        )
        with pytest.raises(BridgeStalledError):
            await it.__anext__()
    finally:
        await source.aclose()
    assert it.stats.failure_classes == {"ProtocolError": 2}
    assert all("temperature must be a number" in f["failure_reason"] for f in it.failures[:2])


def test_regression_native_source_does_not_queue_a_continuously_batching_backend() -> None:
    """Formerly every generator, vLLM included, was wrapped in a BatchingGenerator, so a new
    request waited for the slowest of the previous batch."""
    from gymbridge.bridge import NativeRollouts
    from gymbridge.generation.batching import BatchingGenerator

    class ContinuousBackend:
        continuous_batching = True

        async def generate(self, inputs: object, sampling: object) -> list[object]:
            raise AssertionError("not called")

    backend = ContinuousBackend()
    source = NativeRollouts(backend, "http://127.0.0.1:9")  # type: ignore[arg-type]
    assert source.generator is backend

    class PlainBackend(ContinuousBackend):
        continuous_batching = False

    assert isinstance(NativeRollouts(PlainBackend(), "http://127.0.0.1:9").generator, BatchingGenerator)  # type: ignore[arg-type]
