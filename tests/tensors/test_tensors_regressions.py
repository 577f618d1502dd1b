"""Regression tests for defects found in review of gymbridge.tensors (one test per bug, named after it)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from gymbridge.tensors import PackedTensor, TrainBatch


def _packed() -> tuple[PackedTensor, list[list[torch.Tensor]]]:
    a, b, c = torch.ones(2, 3), torch.zeros(1, 3), torch.full((3, 3), 7.0)
    rows = [[a], [b], [a, c], [], [c]]
    return PackedTensor.from_rows(rows), rows


def _dense(rows: list[list[torch.Tensor]]) -> torch.Tensor | None:
    parts = [t for row in rows for t in row]
    return torch.cat(parts) if parts else None


def _text_batch(lengths: list[int]) -> TrainBatch:
    """A media-free batch built by hand: row r has ``lengths[r]`` tokens ``r*100 + k``."""
    b, width = len(lengths), max(lengths)
    ids = torch.zeros(b, width, dtype=torch.int64)
    mask = torch.zeros(b, width, dtype=torch.int64)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.arange(n) + 100 * r
        mask[r, :n] = 1
    return TrainBatch(
        input_ids=ids,
        attention_mask=mask,
        loss_mask=mask.to(torch.float32),
        logprobs=-mask.to(torch.float32) / 2,
        advantages=torch.arange(b, dtype=torch.float32),
        rewards=torch.arange(b, dtype=torch.float32),
        group_ids=torch.zeros(b, dtype=torch.int64),
        sample_ids=torch.arange(b, dtype=torch.int64),
        segment_ids=torch.zeros(b, dtype=torch.int64),
        sample_mask=torch.ones(b, dtype=torch.bool),
        media={},
        metadata=tuple({"row": r} for r in range(b)),
    )


@pytest.mark.parametrize(
    "sl",
    [
        slice(None, None, -1),
        slice(3, 0, -2),
        slice(-1, None, -3),
        slice(None, None, 2),
        slice(4, 1),
        slice(1, 4, -1),
    ],
)
def test_regression_slices_with_any_step_select_like_a_list(sl: slice) -> None:
    """``pt[::-1]`` used to raise torch's 'step must be greater than zero' ValueError."""
    pt, rows = _packed()
    got = pt[sl]
    assert len(got) == len(rows[sl])
    expected = rows[sl]
    assert got.segment_counts().tolist() == [len(r) for r in expected]
    dense, want = got.materialize(), _dense(expected)
    assert (dense is None and want is None) or (
        dense is not None and want is not None and torch.equal(dense, want)
    )
    batch = _text_batch([3, 1, 4, 2, 5])
    assert batch[sl].sample_ids.tolist() == list(range(5))[sl]


def test_regression_bad_repeat_counts_raise_value_error() -> None:
    """Negative or mis-sized repeat tensors leaked torch RuntimeErrors (the int path said ValueError)."""
    pt, _ = _packed()
    with pytest.raises(ValueError, match=">= 0"):
        pt.repeat_interleave(torch.tensor([1, -1, 1, 1, 1]))
    with pytest.raises(ValueError, match="5 rows"):
        pt.repeat_interleave(torch.tensor([1, 1]))
    batch = _text_batch([2, 3])
    with pytest.raises(ValueError, match=">= 0"):
        batch.repeat_interleave(-1)
    with pytest.raises(ValueError, match="2 rows"):
        batch.repeat_interleave(torch.tensor([1, 2, 3]))
    assert batch.repeat_interleave(torch.tensor([0, 2])).sample_ids.tolist() == [1, 1]


def test_regression_cat_of_batches_missing_a_pack_dim_1_key() -> None:
    """``TrainBatch.cat`` filled a missing media key with a pack_dim=0 empty PackedTensor and then
    refused to cat it with the other parts' pack_dim=1 key (ValueError), so batches with e.g.
    time-packed audio features could not be joined with text-only ones."""
    feats = torch.arange(12.0).reshape(2, 6)
    with_audio = _text_batch([2, 3])
    with_audio = TrainBatch(
        **{f: getattr(with_audio, f) for f in with_audio.__dataclass_fields__ if f != "media"},
        media={"input_features": PackedTensor.from_rows([[feats], []], pack_dim=1)},
    )
    text_only = _text_batch([4])
    joined = TrainBatch.cat([text_only, with_audio])
    got = joined.media["input_features"]
    assert got.pack_dim == 1 and got.segment_counts().tolist() == [0, 1, 0]
    assert torch.equal(got.materialize(), feats)  # type: ignore[arg-type]


def test_regression_unpickled_row_tensors_do_not_alias_readonly_buffers() -> None:
    """Transports (Ray's object store, shared memory) hand out read-only out-of-band buffers.
    Rebuilt token/mask/advantage tensors viewed them directly, so a trainer's in-place edit of
    ``loss_mask`` wrote into memory it does not own (another reader's data, or a fault).
    Per-row tensors are now copied out of read-only buffers; media segments stay zero-copy
    (read-only by contract)."""
    img = torch.randn(64, 32)
    batch = _text_batch([3, 2])
    batch = TrainBatch(
        **{f: getattr(batch, f) for f in batch.__dataclass_fields__ if f != "media"},
        media={"pixel_values": PackedTensor.from_rows([[img], [img]])},
    )
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    readonly = [bytes(memoryview(b)) for b in buffers]
    snapshot = [bytearray(b) for b in readonly]  # real copies (bytes(b) is b)
    back = pickle.loads(stream, buffers=readonly)
    back.loss_mask.mul_(0)
    back.advantages.add_(5)
    back.input_ids.fill_(-1)
    assert [bytearray(b) for b in readonly] == snapshot  # nothing was written into the transport's buffers
    assert torch.equal(batch.loss_mask, _text_batch([3, 2]).loss_mask)
    # the shared media segment is still received without a copy
    seg = back.media["pixel_values"].segments[0]
    assert torch.equal(seg, img)
    addresses = {np.frombuffer(b, dtype=np.uint8).ctypes.data for b in readonly}
    assert seg.data_ptr() in addresses


def test_regression_negative_pack_dim_counts_from_the_end_like_torch() -> None:
    """PackedTensor refused pack_dim=-1 ('must be >= 0'); torch.cat(dim=-1) takes it."""
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(4.0).reshape(2, 2)
    packed = PackedTensor.from_rows([[a], [b, a]], pack_dim=-1)
    assert packed.pack_dim == 1
    expected = torch.cat([a, b, a], dim=-1)
    materialized = packed.materialize()
    assert materialized is not None and torch.equal(materialized, expected)
    # an empty part made with the negative spelling concatenates with the normalised one
    joined = PackedTensor.cat([PackedTensor.empty(1, pack_dim=-1), packed])
    assert len(joined) == 3 and joined.pack_dim == 1
    with pytest.raises(ValueError, match=r"pack_dim -3 out of range for 2-dim segments \(expected -2..1\)"):
        PackedTensor.from_rows([[a]], pack_dim=-3)
