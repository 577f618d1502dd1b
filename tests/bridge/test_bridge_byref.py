"""Media by reference at the Gym request: RowReferencer and GymRollouts(referencer=...)."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bridge_helpers import make_rows, png_data_url
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymbridge.bridge import GymRollouts, RowReferencer
from gymbridge.client import RolloutOutcome
from gymbridge.media import MediaItem, MediaPolicy, MediaServer, MediaStore, encode_data_url, parse_media_ref
from gymbridge.media.refs import DataRef, decode_data_payload, parse_ref
from gymbridge.metrics import PayloadMeter
from gymbridge.protocol import media_refs_of_content


@pytest.fixture
def server(tmp_path: Path) -> Iterator[MediaServer]:
    with MediaServer(MediaStore(tmp_path / "store")) as srv:
        yield srv


def _raw(data_url: str) -> bytes:
    ref = parse_ref(data_url)
    assert isinstance(ref, DataRef)
    return decode_data_payload(ref, max_bytes=1 << 30, source=data_url)


def _sources(row: Any) -> list[str]:
    return [
        s
        for item in row["responses_create_params"]["input"]
        for s, _ in media_refs_of_content(
            item.get("content") if item.get("type", "message") == "message" else item.get("output")
        )
    ]


def test_inline_media_become_references_naming_the_same_bytes(server: MediaServer) -> None:
    row = make_rows(1)[0]
    before = copy.deepcopy(row)
    referencer = RowReferencer(server.store, server.url_for)
    out = referencer.row(row)
    assert row == before  # the row is never mutated
    (text, image) = out["responses_create_params"]["input"][0]["content"]
    assert text is row["responses_create_params"]["input"][0]["content"][0]  # untouched parts: same objects
    key = parse_media_ref(image["image_url"])
    assert key == hashlib.sha256(_raw(png_data_url(0))).hexdigest()
    assert image["image_url"] == server.url_for(key) and image["detail"] == "auto"
    assert out["task_id"] == "t0"
    assert referencer.stored == 1 and referencer.replaced == 1
    # the same prompt again: nothing new stored, the same reference
    again = referencer.row(row)
    assert again == out and referencer.stored == 1 and referencer.replaced == 2
    # loading the reference (verified by key) gives the inline bytes and key
    item = MediaItem.from_ref(image["image_url"], "image", MediaPolicy(media_hosts=(server.host_entry,)))
    assert item.raw == _raw(png_data_url(0)) and item.key == key


def test_every_media_part_spelling_and_tool_output_lists(server: MediaServer) -> None:
    url = png_data_url(3)
    row = {
        "responses_create_params": {
            "input": [
                {"role": "system", "content": "plain text content is text"},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                        {"type": "image", "image": url},
                        {"type": "input_image", "image_url": "https://example.com/a.png"},
                    ],
                },
                {"type": "function_call", "call_id": "c", "name": "look", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [{"type": "input_image", "image_url": url}],
                },
                {"type": "function_call_output", "call_id": "d", "output": url},  # a bare string stays inline
            ],
            "metadata": {"audio_data": "data:audio/wav;base64,AAAA"},
        }
    }
    out = RowReferencer(server.store, server.url_for).row(row)
    items = out["responses_create_params"]["input"]
    ref = server.url_for(hashlib.sha256(_raw(url)).hexdigest())
    assert items[0] is row["responses_create_params"]["input"][0]
    assert items[1]["content"][0]["image_url"] == {"url": ref, "detail": "low"}
    assert items[1]["content"][1]["image"] == ref
    assert items[1]["content"][2]["image_url"] == "https://example.com/a.png"
    assert items[2] is row["responses_create_params"]["input"][2]
    assert items[3]["output"][0]["image_url"] == ref
    assert items[4]["output"] == url
    assert out["responses_create_params"]["metadata"] == row["responses_create_params"]["metadata"]
    assert len(server.store.keys()) == 1


def test_undecodable_inline_media_stay_inline(server: MediaServer) -> None:
    bad = "data:image/png;base64,@@@not-base64@@@"
    big = encode_data_url(b"\x89PNG" + b"x" * 200, "image/png")
    row = {
        "responses_create_params": {
            "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": u} for u in (bad, big)]}
            ]
        }
    }
    out = RowReferencer(server.store, server.url_for, policy=MediaPolicy(max_encoded_bytes=100)).row(row)
    assert out is row and server.store.keys() == []
    assert RowReferencer(server.store, server.url_for).row({"responses_create_params": {"input": "hi"}}) == {
        "responses_create_params": {"input": "hi"}
    }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blobs=st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=4))
def test_references_keep_every_content_key(server: MediaServer, blobs: list[bytes]) -> None:
    urls = [encode_data_url(b, "image/png") for b in blobs]
    row = {
        "responses_create_params": {
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": u} for u in urls]}]
        }
    }
    out = RowReferencer(server.store, server.url_for).row(row)
    keys = [parse_media_ref(s) for s in _sources(out)]
    assert keys == [hashlib.sha256(b).hexdigest() for b in blobs]
    assert all(server.store.get(k) == b for k, b in zip(keys, blobs, strict=True))  # type: ignore[arg-type]


class _Client:
    """Answers every row with the row echoed back (the ``/run`` result shape)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    async def run(
        self, row: dict[str, Any], *, deadline_s: float | None = None, index: int = 0
    ) -> RolloutOutcome:
        self.rows.append(row)
        return RolloutOutcome(
            index=index, row=row, result={**row, "response": {"output": []}, "reward": 0.0}, attempts=1
        )


async def test_base64_media_counted_at_gym_request(server: MediaServer) -> None:
    """Regression: base64 data URLs counted as 0 B of media at gym_request / gym_return."""
    g = 8
    row = make_rows(1)[0]
    nbytes = len(_raw(png_data_url(0)))
    totals = {}
    for on in (False, True):
        meter = PayloadMeter(enabled=True, media_size=server.store.size)
        client = _Client()
        referencer = RowReferencer(server.store, server.url_for) if on else None
        source = GymRollouts(client, meter=meter, referencer=referencer)  # type: ignore[arg-type]
        records = await source.rollouts(row, task_index=0, group_size=g)
        assert all(r.ok for r in records) and len(client.rows) == g
        sent = {_sources(r)[0] for r in client.rows}
        assert len(sent) == 1 and (parse_media_ref(sent.pop()) is not None) == on
        totals[on] = meter.report()
    for boundary in ("gym_request", "gym_return"):
        off, on_ = totals[False][boundary], totals[True][boundary]
        assert off.logical_media_bytes == off.physical_media_bytes == g * nbytes
        assert on_.logical_media_bytes == g * nbytes and on_.physical_media_bytes == nbytes
        assert on_.dedup_ratio == g and on_.num_refs == g and on_.num_segments == 1
        assert on_.serialized_bytes < off.serialized_bytes
