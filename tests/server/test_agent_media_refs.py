"""SimpleAgent with ``media_store_url``: inline media stored once, references replayed.

Without a store every model call re-sends every earlier image of the conversation as
base64 (turn t carries t images); with one, each image is uploaded once and every call
carries ~100-byte references instead.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gymbridge.media.hashing import content_key
from gymbridge.media.refs import DataRef, decode_data_payload, parse_ref
from gymbridge.media.store import MediaServer, MediaStore, parse_media_ref
from gymbridge.metrics import PayloadMeter
from gymbridge.protocol import media_ref_of_part
from gymbridge.server import ResourcesServer, RunningServer, SimpleAgent, start_server
from gymbridge.server.examples import CounterEnv, counter_rows, png_of
from gymbridge.testing.scripted_model import ScriptedModelServer
from gymbridge_envs.grid_door.data import generate as grid_door_rows
from gymbridge_envs.grid_door.server import GridDoorServer


@pytest.fixture
def media(tmp_path: Path) -> Iterator[MediaServer]:
    with MediaServer(MediaStore(tmp_path / "media")) as server:
        yield server


async def _run(
    env_server: ResourcesServer, script: Any, row: dict[str, Any], **agent_kwargs: Any
) -> tuple[dict[str, Any], ScriptedModelServer]:
    env: RunningServer = await start_server(env_server)
    model = ScriptedModelServer(script)
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url, **agent_kwargs))
    try:
        async with aiohttp.ClientSession() as http, http.post(agent.url + "/run", json=row) as reply:
            assert reply.status == 200, await reply.text()
            result: dict[str, Any] = await reply.json()
    finally:
        await agent.stop()
        await model.stop()
        await env.stop()
    return result, model


def _media_urls(items: list[Any]) -> list[str]:
    urls: list[str] = []
    for item in items:
        parts = item.get("content") if item.get("type", "message") == "message" else item.get("output")
        for part in parts if isinstance(parts, list) else []:
            ref = media_ref_of_part(part)
            if ref is not None:
                urls.append(ref[0])
    return urls


def _bytes_of(data_url: str) -> bytes:
    ref = parse_ref(data_url)
    assert isinstance(ref, DataRef)
    return decode_data_payload(ref, max_bytes=1 << 30, source="test")


def _grid_door_row(turns: int) -> dict[str, Any]:
    row = next(iter(grid_door_rows(1, seed=3)))
    return {**row, "max_steps": turns}


async def _grid_door_episode(turns: int, **agent_kwargs: Any) -> tuple[dict[str, Any], ScriptedModelServer]:
    # "stay" is no action: every turn is a step that neither wins nor ends the episode early
    return await _run(
        GridDoorServer(),
        ["<action>stay</action>"],
        _grid_door_row(turns),
        gymnasium=True,
        max_steps=turns,
        **agent_kwargs,
    )


async def test_grid_door_agent_to_model_bytes_grow_linearly_with_references(media: MediaServer) -> None:
    turns = 10
    inline_meter = PayloadMeter(enabled=True)
    inline, inline_model = await _grid_door_episode(turns, meter=inline_meter)
    meter = PayloadMeter(enabled=True)
    referenced, ref_model = await _grid_door_episode(turns, media_store_url=media.base_url, meter=meter)
    assert len(inline_model.requests) == len(ref_model.requests) == turns
    inline_media = [sum(len(u) for u in _media_urls(r["input"])) for r in inline_model.requests]
    ref_media = [sum(len(u) for u in _media_urls(r["input"])) for r in ref_model.requests]
    smallest_image = min(len(u) for r in inline_model.requests for u in _media_urls(r["input"]))
    # without references call t carries t images: each call's media grow by a whole image
    assert all(b - a >= smallest_image for a, b in itertools.pairwise(inline_media))
    # with references by one URL (~100 bytes), never by an image
    url = len(media.url_for("0" * 64))
    assert ref_media == [url * t for t in range(1, turns + 1)]
    # everything but the media is byte-identical: the JSON sizes differ by the media alone
    for inline_request, ref_request, a, b in zip(
        inline_model.requests, ref_model.requests, inline_media, ref_media, strict=True
    ):
        assert len(json.dumps(inline_request)) - len(json.dumps(ref_request)) == a - b
    # the images crossed once each, through the store (uploads = distinct observations)
    assert media.store.keys() and len(media.store.keys()) <= turns
    # model_request metering: logical = every copy (as inline), physical = each image once
    report = meter.report()["model_request"]
    inline_report = inline_meter.report()["model_request"]
    assert report.records == inline_report.records == turns
    assert report.logical_media_bytes == inline_report.logical_media_bytes
    assert inline_report.physical_media_bytes == inline_report.logical_media_bytes
    stored = media.store.keys()
    assert report.physical_media_bytes == sum(len(media.store.get(k)) for k in stored)
    assert report.num_refs == inline_report.num_refs == turns * (turns + 1) // 2  # call t: t images
    # the same episode otherwise: the items differ only in their image URLs
    assert referenced["reward"] == inline["reward"]
    assert len(referenced["response"]["output"]) == len(inline["response"]["output"])


async def test_grid_door_references_name_the_inline_bytes(media: MediaServer) -> None:
    inline, _ = await _grid_door_episode(3)
    referenced, model = await _grid_door_episode(3, media_store_url=media.base_url)
    inline_urls = _media_urls(inline["responses_create_params"]["input"] + inline["response"]["output"])
    ref_urls = _media_urls(referenced["responses_create_params"]["input"] + referenced["response"]["output"])
    assert len(inline_urls) == len(ref_urls) == 3
    for data_url, ref in zip(inline_urls, ref_urls, strict=True):
        assert data_url.startswith("data:image/png;base64,")
        key = parse_media_ref(ref)
        assert key == content_key(_bytes_of(data_url))
        assert ref == media.url_for(key)
        assert media.store.get(key) == _bytes_of(data_url)
    # every model call saw references only, never a data URL
    for request in model.requests:
        assert all(parse_media_ref(u) for u in _media_urls(request["input"]))


async def test_tool_image_is_stored_once_and_referenced_from_the_next_call(media: MediaServer) -> None:
    script = [
        {"calls": [{"name": "snapshot", "arguments": {}}]},
        {"calls": [{"name": "snapshot", "arguments": {}}]},
        "done",
    ]
    result, model = await _run(CounterEnv(), script, counter_rows(1)[0], media_store_url=media.base_url)
    key = content_key(png_of(0))
    assert media.store.keys() == [key]  # the same image twice: stored once
    assert _media_urls(model.requests[0]["input"]) == []
    assert _media_urls(model.requests[1]["input"]) == [media.url_for(key)]
    assert _media_urls(model.requests[2]["input"]) == [media.url_for(key)] * 2
    assert _media_urls(result["response"]["output"]) == [media.url_for(key)] * 2
    assert media.requests_served == 0  # the scripted model never fetched; the agent only uploaded


async def test_row_items_are_not_mutated_by_referencing(media: MediaServer) -> None:
    row = _grid_door_row(2)
    before = json.dumps(row, sort_keys=True)
    await _run(
        GridDoorServer(), ["<action>stay</action>"], row, gymnasium=True, media_store_url=media.base_url
    )
    assert json.dumps(row, sort_keys=True) == before


async def test_store_refusing_an_upload_ends_the_rollout_with_502(tmp_path: Path) -> None:
    with MediaServer(MediaStore(tmp_path / "tiny", max_bytes=16)) as small:
        env = await start_server(GridDoorServer())
        model = ScriptedModelServer(["<action>stay</action>"])
        await model.start()
        agent = await start_server(
            SimpleAgent(
                resources_url=env.url, model_url=model.url, gymnasium=True, media_store_url=small.base_url
            )
        )
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.post(agent.url + "/run", json=_grid_door_row(2)) as reply,
            ):
                assert reply.status == 502
                assert "media store" in await reply.text()
        finally:
            await agent.stop()
            await model.stop()
            await env.stop()
        assert model.num_calls == 0  # nothing half-referenced reached the model


def test_media_part_takes_a_media_item() -> None:
    """Regression: ``ToolOutput(media=[MediaItem])`` raised TypeError (the duck type named a
    method MediaItem does not have), so a tool could not answer a loaded item."""
    from gymbridge.media import MediaItem
    from gymbridge.server import ToolOutput

    item = MediaItem.from_bytes(png_of(3), "image")
    (part,) = ToolOutput(media=[item]).parts()
    assert part["type"] == "input_image"
    assert _bytes_of(part["image_url"]) == png_of(3)
