"""References on or off: the same tokens, logprobs and content keys (seeded, the real tiny model).

A grid_door episode runs through SimpleAgent against our model server twice, once with media
inline and once with ``media_store_url`` (every image stored once, referenced afterwards); the
model server fetches the references from the store (a listed media host). Everything the
trainer consumes must be identical.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.server import ModelServer, ModelServerConfig
from gymbridge.media import MediaPolicy
from gymbridge.media.store import MediaServer, MediaStore, parse_media_ref
from gymbridge.metrics import PayloadMeter
from gymbridge.server import SimpleAgent, start_server
from gymbridge.trajectory import from_gym_result
from gymbridge_envs.grid_door.data import generate as grid_door_rows
from gymbridge_envs.grid_door.server import GridDoorServer

pytestmark = pytest.mark.integration

TOKEN_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


@pytest.fixture
def media(tmp_path: Path) -> Iterator[MediaServer]:
    with MediaServer(MediaStore(tmp_path / "media")) as server:
        yield server


def _row(turns: int) -> dict[str, Any]:
    row = next(iter(grid_door_rows(1, seed=5)))
    rcp = {**row["responses_create_params"], "temperature": 1.0, "seed": 1234, "max_output_tokens": 6}
    return {**row, "responses_create_params": rcp, "max_steps": turns}


async def _episode(
    gen: HFGenerator, media: MediaServer, turns: int, *, by_reference: bool, meter: PayloadMeter | None = None
) -> tuple[dict[str, Any], ModelServer]:
    model = ModelServer(
        gen,
        config=ModelServerConfig(model_name="tiny", max_model_len=4096, default_max_tokens=6),
        media_policy=MediaPolicy(media_hosts=(media.host_entry,)),
    )
    await model.start()
    env = await start_server(GridDoorServer())
    agent = await start_server(
        SimpleAgent(
            resources_url=env.url,
            model_url=str(model.url),
            gymnasium=True,
            max_steps=turns,
            media_store_url=media.base_url if by_reference else None,
            meter=meter,
        )
    )
    try:
        async with aiohttp.ClientSession() as http, http.post(agent.url + "/run", json=_row(turns)) as reply:
            assert reply.status == 200, await reply.text()
            result: dict[str, Any] = await reply.json()
    finally:
        await agent.stop()
        await env.stop()
        await model.stop()
    return result, model


def _token_fields(result: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        tuple(o.get(k) for k in TOKEN_KEYS)
        for o in result["response"]["output"]
        if "generation_token_ids" in o
    ]


async def test_tokens_logprobs_and_content_keys_identical_with_references_on_or_off(
    tiny_gen: HFGenerator, media: MediaServer
) -> None:
    turns = 3
    inline, _ = await _episode(tiny_gen, media, turns, by_reference=False)
    meter = PayloadMeter(enabled=True)
    referenced, model = await _episode(tiny_gen, media, turns, by_reference=True, meter=meter)
    assert len(_token_fields(inline)) == turns
    assert _token_fields(referenced) == _token_fields(inline)
    assert referenced["reward"] == inline["reward"]
    # the result carries references, and they name the inline bytes
    policy = MediaPolicy(media_hosts=(media.host_entry,))
    traj_inline = from_gym_result(inline, media_policy=policy)
    traj_ref = from_gym_result(referenced, media_policy=policy)
    keys_inline = [[m.key for m in t.media] for t in traj_inline.turns]
    keys_ref = [[m.key for m in t.media] for t in traj_ref.turns]
    assert keys_ref == keys_inline and sum(map(len, keys_ref)) == turns
    sources = [m.source for t in traj_ref.turns for m in t.media]
    assert all(parse_media_ref(s) is not None for s in sources)
    for a, b in zip(traj_inline.turns, traj_ref.turns, strict=True):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.generation_token_ids == b.generation_token_ids
        assert a.generation_logprobs == b.generation_logprobs
    # each distinct image fetched by the model server once, however many calls re-sent it
    fetched = model.media_cache.stats()["kinds"]["fetched:image"]
    assert fetched["misses"] == len(set(media.store.keys()))
    assert fetched["hits"] == turns * (turns + 1) // 2 - fetched["misses"]
    report = meter.report()["model_request"]
    keys = media.store.keys()
    stored = {k: len(media.store.get(k)) for k in keys}
    assert report.records == turns and report.num_refs == turns * (turns + 1) // 2
    assert report.physical_media_bytes == sum(stored.values())  # each image once
    copies = [parse_media_ref(m.source) for t in traj_ref.turns for m in t.media]
    assert report.logical_media_bytes == sum(stored[k] * (turns - i) for i, k in enumerate(copies))
