"""payload_stats and PayloadMeter: out-of-band bytes counted, media bytes, per-shard totals, table."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.metrics import BOUNDARIES, PayloadMeter, payload_stats
from gymbridge.tensors import PackedTensor


def _group(g: int, nbytes_per_image: int = 64 * 1024) -> PackedTensor:
    img = torch.randn(nbytes_per_image // 4)[None, :]
    return PackedTensor.from_rows([[img]] * g)


def test_payload_stats_counts_out_of_band_buffers() -> None:
    pt = _group(16)
    stats = payload_stats(pt)
    assert stats.out_of_band_bytes >= pt.physical_nbytes and stats.num_buffers >= 1
    assert stats.serialized_bytes == stats.inband_bytes + stats.out_of_band_bytes
    assert stats.physical_media_bytes == 64 * 1024 and stats.logical_media_bytes == 16 * 64 * 1024
    assert stats.dedup_ratio == 16 and stats.num_segments == 1 and stats.num_refs == 16
    off = payload_stats(pt.unshared())
    assert off.serialized_bytes / stats.serialized_bytes > 15.5  # the dedup saving shows in real bytes
    # plain tensors pickle in band: still counted, no media found
    plain = payload_stats({"x": torch.zeros(1000)})
    assert plain.serialized_bytes >= 4000 and plain.physical_media_bytes == 0 and plain.dedup_ratio == 1.0


def test_payload_stats_walks_containers() -> None:
    a, b = _group(2, 1024), _group(3, 2048)
    stats = payload_stats({"a": a, "nested": [b, (a,)]})
    assert stats.physical_media_bytes == 1024 + 2048  # `a` appears twice but is one object
    assert stats.logical_media_bytes == 2 * 1024 + 3 * 2048
    assert stats.serialized_bytes > stats.physical_media_bytes
    assert len(pickle.dumps({"a": a}, protocol=5)) > 0


def test_meter_is_off_by_default_and_records_nothing() -> None:
    meter = PayloadMeter()
    assert meter.record("rollout_to_policy", _group(4)) is None
    assert meter.report() == {}
    with pytest.raises(ValueError, match="unknown payload boundary"):
        meter.record("rollout_to_polcy", _group(1))


def test_meter_per_boundary_and_per_shard_totals() -> None:
    meter = PayloadMeter(enabled=True, extra_boundaries=["checkpoint"])
    assert set(BOUNDARIES) <= set(meter.boundaries) and "checkpoint" in meter.boundaries
    batch = _group(16)
    full = meter.record("rollout_to_policy", batch)
    assert full is not None
    shards = batch.shard(2)
    sizes = [meter.record("policy_shard", s, shard=i) for i, s in enumerate(shards)]
    meter.record("policy_shard", shards[0], shard=0)  # a second step's shard 0
    report = meter.report()
    assert list(report) == ["rollout_to_policy", "policy_shard"]  # docs/design.md order, recorded only
    ps = report["policy_shard"]
    assert ps.records == 3
    assert ps.shard_serialized_bytes[0] == 2 * sizes[0].serialized_bytes  # type: ignore[union-attr]
    assert ps.max_shard_bytes == ps.shard_serialized_bytes[0]
    assert report["rollout_to_policy"].dedup_ratio == 16
    table = meter.table()
    assert "rollout_to_policy" in table and "policy_shard" in table and "16.00x" in table
    assert len(table.splitlines()) == 4
    meter.reset()
    assert meter.report() == {}


def test_two_containers_sharing_a_segment_each_ship_it() -> None:
    """The docstring's rule: a segment shared by two containers is counted (and sent) once per container."""
    pt = _group(4, 4096)
    shard = pt.select([0])  # a second PackedTensor over the same segment
    stats = payload_stats([pt, shard])
    assert stats.physical_media_bytes == 2 * 4096 and stats.logical_media_bytes == 5 * 4096
    assert stats.out_of_band_bytes >= 2 * 4096  # what pickle really sends matches the count


def test_regression_report_is_a_snapshot() -> None:
    """``report()`` handed out the meter's live totals: a report kept for step N kept growing
    with step N+1's records (and could be read mid-update from another thread)."""
    meter = PayloadMeter(enabled=True)
    meter.record("policy_shard", _group(2, 1024), shard=0)
    step_n = meter.report()
    meter.record("policy_shard", _group(2, 1024), shard=0)
    assert step_n["policy_shard"].records == 1
    assert step_n["policy_shard"].shard_serialized_bytes[0] == step_n["policy_shard"].serialized_bytes
    assert meter.report()["policy_shard"].records == 2


# ----------------------------------------------------------------------------- media strings in JSON


@given(st.binary(min_size=0, max_size=200), st.sampled_from(["image/png", "audio/wav", "video/mp4"]))
def test_data_url_media_bytes_is_the_decoded_length(raw: bytes, mime: str) -> None:
    from gymbridge.media import encode_data_url
    from gymbridge.metrics.payload import data_url_media_bytes

    assert data_url_media_bytes(encode_data_url(raw, mime)) == len(raw)
    assert data_url_media_bytes(encode_data_url(raw, "text/plain")) is None
    assert data_url_media_bytes("plain text") is None


def test_references_count_once_per_scope_and_their_url_is_not_media() -> None:
    key = "ab" * 32
    ref = f"http://127.0.0.1:9/media/{key}"
    body = {"input": [{"content": [{"type": "input_image", "image_url": ref}]}] * 3, "text": "x" * 100}
    stats = payload_stats(body, media_size=lambda k: 1000 if k == key else None)
    assert (stats.logical_media_bytes, stats.physical_media_bytes) == (3000, 1000)
    assert stats.num_refs == 3 and stats.num_segments == 1
    scope: set[str] = set()
    meter = PayloadMeter(enabled=True, media_size=lambda k: 1000)
    first = meter.record("gym_request", body, sent_keys=scope)
    second = meter.record("gym_request", body, sent_keys=scope)
    assert first is not None and second is not None
    assert first.physical_media_bytes == 1000 and second.physical_media_bytes == 0
    assert meter.report()["gym_request"].dedup_ratio == 6
    # an unknown size: the reference is counted, its bytes are not guessed
    assert payload_stats(body).logical_media_bytes == 0 and payload_stats(body).num_refs == 3
