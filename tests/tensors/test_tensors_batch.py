"""TrainBatch + MediaProcessor on the tiny offline Qwen2-VL: the mixed batch of issue 4 and every op."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensor_helpers import image, mixed_batch, png_bytes, traj, turn

from gymbridge.errors import TrajectoryError
from gymbridge.media import MediaItem
from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.tensors import MediaProcessor, TrainBatch, group_advantages
from gymbridge.trajectory.types import Trajectory, Turn

G = 4


@pytest.fixture
def proc(tiny: TinyVLM) -> MediaProcessor:
    return MediaProcessor(tiny.processor)


@pytest.fixture
def batch(tiny: TinyVLM, proc: MediaProcessor) -> TrainBatch:
    return TrainBatch.from_trajectories(mixed_batch(tiny, G), proc, group_size=G)


def _reference_pixels(tiny: TinyVLM, trajectories: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Process every image reference separately with the HF image processor (no dedup at all)."""
    images = [m.image() for t in trajectories for tn in t.turns for m in tn.media]
    feats = tiny.processor.image_processor(images=images, return_tensors="pt")
    return feats["pixel_values"], feats["image_grid_thw"]


def test_regression_mixed_image_first_and_text_first_tool_image_groups(
    tiny: TinyVLM, proc: MediaProcessor
) -> None:
    """NeMo-RL's list-based CSR crashed on this batch: an image-first prompt group, a text-first
    group whose tool returns images in two turns, and text-only rows. Here it builds, keeps one
    logical row per conversation, and matches processing every reference separately."""
    trajs = mixed_batch(tiny, G)
    batch = TrainBatch.from_trajectories(trajs, proc, group_size=G)
    assert len(batch) == 3 * G
    assert set(batch.media) == {"pixel_values", "image_grid_thw"}
    pv, grid = batch.media["pixel_values"], batch.media["image_grid_thw"]
    assert len(pv) == len(grid) == 3 * G  # one logical row per conversation, tool images are extra refs
    assert pv.segment_counts().tolist() == [1] * G + [2] * G + [0] * G
    # one prompt image (loaded G times separately) + one shared tool image + G unique tool images
    assert pv.num_segments == 1 + 1 + G and grid.num_segments == 1 + 1 + G
    ref_pv, ref_grid = _reference_pixels(tiny, trajs)
    assert torch.equal(pv.materialize(), ref_pv)
    assert torch.equal(grid.materialize(), ref_grid)
    # tokens are the rollout's: placeholders in input_ids agree with the grids
    n_pad = int((batch.input_ids == tiny.image_token_id).sum())
    assert n_pad == int(ref_grid.prod(-1).sum()) // 4
    assert batch.group_ids.tolist() == [0] * G + [1] * G + [2] * G
    # the tiny model consumes the batch's media directly
    row = batch.select([G])  # a text-first sample with two tool images
    length = int(row.lengths[0])
    ids = row.input_ids[:, :length]
    with torch.no_grad():
        out = tiny.model(
            input_ids=ids,
            attention_mask=row.attention_mask[:, :length],
            pixel_values=row.media["pixel_values"].materialize(),
            image_grid_thw=row.media["image_grid_thw"].materialize(),
            mm_token_type_ids=tiny.processor.mm_token_type_ids(ids),
        )
    assert torch.isfinite(out.logits).all()


def test_each_content_key_is_processed_once_whatever_g(tiny: TinyVLM) -> None:
    for g in (2, 8):
        proc = MediaProcessor(tiny.processor)
        raw = png_bytes((1, 2, 3))
        trajs = [
            traj([turn(tiny, 0, [MediaItem.from_bytes(raw, "image")])], reward=float(i)) for i in range(g)
        ]
        batch = TrainBatch.from_trajectories(trajs, proc, group_size=g)
        assert proc.stats.items_requested == g and proc.stats.items_processed == 1
        assert batch.media["pixel_values"].num_segments == 1
        ratio = batch.media["pixel_values"].logical_nbytes / batch.media["pixel_values"].physical_nbytes
        assert ratio == g


def test_provenance_depends_on_processor_spec(tiny: TinyVLM) -> None:
    item = image((9, 9, 9))
    a = MediaProcessor(tiny.processor).process([item])[item.key]
    b = MediaProcessor(tiny.processor).process([item])[item.key]
    assert a.provenance == b.provenance  # separately built, same config: mergeable
    other = type(tiny.processor)(tiny.tokenizer, type(tiny.processor.image_processor)(max_pixels=112 * 112))
    c = MediaProcessor(other).process([item])[item.key]
    assert c.provenance["pixel_values"] != a.provenance["pixel_values"]
    assert len(set(a.provenance.values())) == 2  # output keys never collide


def test_placeholder_mismatch_names_the_turn(tiny: TinyVLM, proc: MediaProcessor) -> None:
    bad = traj([turn(tiny, 0, []), turn(tiny, 1, [image((5, 5, 5))], placeholders=[3])], reward=1.0)
    with pytest.raises(TrajectoryError, match=r"output item 2: trajectory 1 turn 1: prompt holds 3 image"):
        TrainBatch.from_trajectories([traj([turn(tiny, 0, [])], 0.0), bad], proc, group_size=2)
    silent = traj([turn(tiny, 0, [image((5, 5, 5))], placeholders=[])], reward=1.0)
    with pytest.raises(TrajectoryError, match="holds 0 image placeholder"):
        TrainBatch.from_trajectories([silent], proc, group_size=1)
    with pytest.raises(TrajectoryError, match="no MediaProcessor"):
        TrainBatch.from_trajectories([silent], None, group_size=1)


def test_advantages_rewards_and_masked_samples(tiny: TinyVLM, proc: MediaProcessor) -> None:
    rewards = [1.0, 0.0, 0.0, 3.0, 2.0, 2.0]
    trajs = [traj([turn(tiny, 0, [])], r, mask_sample=(i == 3)) for i, r in enumerate(rewards)]
    batch = TrainBatch.from_trajectories(trajs, proc, group_size=3)
    g0 = torch.tensor([1.0, 0.0, 0.0])
    expected0 = (g0 - g0.mean()) / (g0.std() + 1e-6)
    assert torch.allclose(batch.advantages[:3], expected0)
    # masked sample: advantage 0, loss mask 0, out of its group's stats (others equal -> 0)
    assert batch.advantages[3:].tolist() == [0.0, 0.0, 0.0]
    assert batch.loss_mask[3].sum() == 0 and batch.sample_mask.tolist() == [True] * 3 + [False, True, True]
    assert batch.rewards.tolist() == rewards
    mean_only = group_advantages(torch.tensor(rewards), 3, mode="group_mean")
    assert torch.allclose(mean_only[:3], g0 - g0.mean())
    with pytest.raises(ValueError, match="groups of 4"):
        TrainBatch.from_trajectories(trajs, proc, group_size=4)
    with pytest.raises(TrajectoryError, match="not finite"):
        TrainBatch.from_trajectories([traj([turn(tiny, 0, [])], float("nan"))], proc, group_size=1)


def test_split_trajectory_gives_rows_sharing_reward(tiny: TinyVLM, proc: MediaProcessor) -> None:
    img0, img1 = image((1, 1, 1)), image((2, 2, 2))
    split = traj([turn(tiny, 0, [img0]), turn(tiny, 1, [img1], segment=1)], reward=2.0)
    other = traj([turn(tiny, 0, [image((1, 1, 1))])], reward=0.0)
    batch = TrainBatch.from_trajectories([split, other], proc, group_size=2)
    assert len(batch) == 3
    assert batch.sample_ids.tolist() == [0, 0, 1] and batch.segment_ids.tolist() == [0, 1, 0]
    assert batch.rewards.tolist() == [2.0, 2.0, 0.0]
    assert batch.advantages[0] == batch.advantages[1] > 0 > batch.advantages[2]
    assert batch.media["pixel_values"].segment_counts().tolist() == [1, 1, 1]
    assert batch.media["pixel_values"].num_segments == 2  # img0 and the other's copy merge
    gen = split.turns[0].generation_token_ids
    assert batch.input_ids[0, : batch.lengths[0]].tolist() == split.token_ids(0)
    assert batch.loss_mask[0].sum() == len(gen)
    assert torch.allclose(batch.logprobs[0, : batch.lengths[0]], torch.tensor(split.logprobs(0)))


@pytest.mark.parametrize("mode", ["batch_norm", "batch_mean"])
def test_batch_advantages_baseline_the_whole_batch(tiny: TinyVLM, proc: MediaProcessor, mode: str) -> None:
    """A group whose rollouts all earned one reward gets no signal from its own mean; with a batch
    mode its sign says whether that reward beat the batch's. A split (two-row) sample counts
    once, a masked sample gets 0 and stays out of the mean and std."""
    img = image((1, 1, 1))
    wrong = [traj([turn(tiny, 0, [img])], 0.0) for _ in range(2)]  # a zero-variance group
    split = traj([turn(tiny, 0, [img]), turn(tiny, 1, [image((2, 2, 2))], segment=1)], reward=1.0)
    right = [split, traj([turn(tiny, 0, [img])], 1.0)]
    masked = [traj([turn(tiny, 0, [img])], 1.0), traj([turn(tiny, 0, [img])], 5.0, mask_sample=True)]
    parts = [TrainBatch.from_trajectories(g, proc, group_size=2) for g in (wrong, right, masked)]
    joined = TrainBatch.cat(parts, renumber=True)
    assert joined.advantages.tolist()[:2] == [0.0, 0.0]  # the group baseline: nothing to learn
    out = joined.batch_advantages(mode)  # type: ignore[arg-type]
    assert joined.advantages.tolist()[:2] == [0.0, 0.0]  # a copy
    assert out.sample_ids.tolist() == [0, 1, 2, 2, 3, 4, 5]  # the split sample's two rows
    # one reward per trainable sample: 0, 0, 1, 1, 1 (the masked 5.0 left out)
    want = group_advantages(torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]), 1, mode=mode)  # type: ignore[arg-type]
    w = want.tolist()
    assert out.advantages.tolist() == pytest.approx([w[0], w[1], w[2], w[2], w[3], w[4], 0.0])
    assert out.advantages[0] < 0 < out.advantages[2]
    if mode == "batch_mean":
        assert out.advantages[0].item() == pytest.approx(-0.6)
    # the same modes straight from trajectories: everything given is the batch
    direct = TrainBatch.from_trajectories(wrong + right + masked, proc, group_size=2, advantage=mode)  # type: ignore[arg-type]
    assert torch.allclose(direct.advantages, out.advantages)
    with pytest.raises(ValueError, match="batch_norm"):
        joined.batch_advantages("group_norm")


def test_dedup_off_is_the_same_batch_with_copies(tiny: TinyVLM) -> None:
    trajs = mixed_batch(tiny, G)
    on = TrainBatch.from_trajectories(trajs, MediaProcessor(tiny.processor), group_size=G)
    off = TrainBatch.from_trajectories(trajs, MediaProcessor(tiny.processor), group_size=G, dedup=False)
    for key in on.media:
        assert torch.equal(on.media[key].materialize(), off.media[key].materialize())
        assert off.media[key].num_segments == off.media[key].num_refs
    assert torch.equal(on.input_ids, off.input_ids) and torch.equal(on.advantages, off.advantages)
    size_on = len(pickle.dumps(on, protocol=5))
    size_off = len(pickle.dumps(off, protocol=5))
    assert size_off > 1.5 * size_on


def test_select_repeat_cat(batch: TrainBatch) -> None:
    assert repr(batch).startswith(f"TrainBatch(rows={3 * G}, ")
    assert "pixel_values: 6 segments/12 refs" in repr(batch)
    rep = batch.repeat_interleave(2)
    assert len(rep) == 2 * len(batch)
    assert rep.media["pixel_values"].num_segments == batch.media["pixel_values"].num_segments
    assert torch.equal(rep.input_ids[::2], batch.input_ids)
    sub = batch[[0, G]]
    assert sub.media["pixel_values"].segment_counts().tolist() == [1, 2]
    assert sub.media["pixel_values"].num_segments == 3
    both = TrainBatch.cat([batch[: G + 1], batch[G + 1 :]])
    for key in batch.media:
        assert torch.equal(both.media[key].materialize(), batch.media[key].materialize())
        assert both.media[key].num_segments == batch.media[key].num_segments
    assert torch.equal(both.input_ids, batch.input_ids)
    text_only = batch[2 * G :].trim()
    assert all(len(v.segments) == 0 for v in text_only.media.values())
    mixed = TrainBatch.cat([text_only, batch[:1]])
    assert mixed.seq_len == batch.seq_len and len(mixed.media["pixel_values"]) == G + 1
    with pytest.raises(IndexError):
        batch.select([len(batch)])


def test_cat_renumber_keeps_separately_built_groups_apart(tiny: TinyVLM, proc: MediaProcessor) -> None:
    trajs = mixed_batch(tiny, G)
    parts = [TrainBatch.from_trajectories(trajs[k : k + G], proc, group_size=G) for k in range(0, 3 * G, G)]
    assert all(p.group_ids.tolist() == [0] * G for p in parts)
    joined = TrainBatch.cat(parts, renumber=True)
    assert joined.group_ids.tolist() == [0] * G + [1] * G + [2] * G
    assert joined.sample_ids.tolist() == list(range(3 * G))
    assert [sorted(set(s.group_ids.tolist())) for s in joined.shard(2)] == [[1], [0, 2]]  # groups whole
    whole = TrainBatch.from_trajectories(trajs, proc, group_size=G)
    assert torch.equal(joined.group_ids, whole.group_ids)
    assert torch.allclose(joined.advantages, whole.advantages)
    assert torch.equal(joined.media["pixel_values"].materialize(), whole.media["pixel_values"].materialize())
    assert TrainBatch.cat(parts).group_ids.tolist() == [0] * (3 * G)  # default: ids kept as they are


def test_shard_is_group_aware_balances_tokens_and_reinterns(tiny: TinyVLM, proc: MediaProcessor) -> None:
    trajs = mixed_batch(tiny, G)
    batch = TrainBatch.from_trajectories(trajs, proc, group_size=G)
    per_group = {g: int(batch.lengths[batch.group_ids == g].sum()) for g in range(3)}
    assert per_group == {0: 88, 1: 144, 2: 32}  # rows of 22, 36 and 8 tokens
    halves = batch.shard(2)
    # by rows it would be 6 + 6 (a group split); by tokens whole groups give 144 vs 120
    assert [sorted(set(h.group_ids.tolist())) for h in halves] == [[1], [0, 2]]
    assert [int(h.lengths.sum()) for h in halves] == [144, 120]
    assert [len(h) for h in halves] == [G, 2 * G]
    # each shard holds only what it references: group 1's shared tool image + 4 unique ones; group 0's one
    assert [h.media["pixel_values"].num_segments for h in halves] == [5, 1]
    only_text = batch.select([8, 9, 10, 11]).shard(2)
    assert [s.media["pixel_values"].num_segments for s in only_text] == [0, 0]
    # three shards: group 1 (144 tokens, over the 88 target) is the only one split
    thirds = batch.shard(3)
    loads = [int(s.lengths.sum()) for s in thirds]
    assert sum(loads) == 264 and max(loads) - min(loads) <= 36  # within one row of the longest length
    split = [g for g in range(3) if sum(g in set(s.group_ids.tolist()) for s in thirds) > 1]
    assert split == [1]
    # sizes that cannot keep groups whole: no row lost, none twice
    odd = batch.shard(5)
    assert sorted(torch.cat([s.sample_ids for s in odd]).tolist()) == list(range(len(batch)))
    many = batch.shard(20)  # more shards than rows: some are empty, none holds more than a long row
    assert sum(len(s) for s in many) == len(batch) and max(int(s.lengths.sum()) for s in many) == 36
    flat = batch.shard(2, group_aware=False)
    assert sorted(int(s.lengths.sum()) for s in flat) == [132, 132]


def test_modality_rows_marks_the_rows_holding_each_modality(batch: TrainBatch) -> None:
    rows = batch.modality_rows()
    assert set(rows) == {"image"}  # pixel_values and image_grid_thw: one modality
    assert rows["image"].tolist() == [True] * (2 * G) + [False] * G
    for key in ("pixel_values", "image_grid_thw"):
        assert torch.equal(rows["image"], batch.media[key].segment_counts() > 0)
    text = batch[2 * G :]
    assert not text.modality_rows()["image"].any()
    picked = batch.select([2 * G, 0, 2 * G + 1])
    assert picked.modality_rows()["image"].tolist() == [False, True, False]
    assert batch[:0].modality_rows()["image"].shape == (0,)


def test_without_loss_trains_nothing_and_keeps_tokens_and_media(batch: TrainBatch) -> None:
    masked = batch.select([1, G]).without_loss()
    assert float(masked.loss_mask.abs().sum()) == 0 and not masked.sample_mask.any()
    assert float(masked.advantages.abs().sum()) == 0
    kept = batch.select([1, G])
    assert torch.equal(masked.input_ids, kept.input_ids) and torch.equal(masked.rewards, kept.rewards)
    for key in kept.media:
        assert torch.equal(masked.media[key].materialize(), kept.media[key].materialize())
    assert float(batch.loss_mask.sum()) > 0 and bool(batch.sample_mask.all())  # the source is untouched
    joined = TrainBatch.cat([batch[2 * G :], masked])  # a text shard given masked image rows
    assert float(joined.loss_mask.sum()) == float(batch[2 * G :].loss_mask.sum())
    assert joined.modality_rows()["image"].tolist() == [False] * G + [True, True]


def test_micro_batches_respect_the_token_budget(batch: TrainBatch) -> None:
    budget = int(batch.lengths.max()) * 3
    mbs = batch.micro_batches(budget)
    seen = sorted(torch.cat([m.sample_ids for m in mbs]).tolist())
    assert seen == list(range(len(batch)))
    for m in mbs:
        assert len(m) * m.seq_len <= budget
        assert m.seq_len == int(m.lengths.max())  # trimmed
        assert len(m.media["pixel_values"]) == len(m)
    assert len(batch.micro_batches(10**9)) == 1


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_row_longer_than_the_budget_gets_a_micro_batch_of_its_own(batch: TrainBatch, packed: bool) -> None:
    """Regression: a row over ``micro_batch_max_tokens`` used to raise ValueError and fail the step."""
    lengths = batch.lengths.tolist()
    budget = int(batch.lengths.max()) - 1
    mbs = batch.micro_batches(budget, packed=packed)
    rows = [m.sample_ids.tolist() for m in mbs]
    assert sorted(r for b in rows for r in b) == list(range(len(batch)))
    for m, ids in zip(mbs, rows, strict=True):
        assert ids == sorted(ids)  # batch order inside a micro-batch
        run = int(m.lengths.sum()) if packed else len(m) * m.seq_len
        assert run <= budget or (len(m) == 1 and lengths[ids[0]] > budget)
    over = [i for i, n in enumerate(lengths) if n > budget]
    assert over and all([i] in rows for i in over)
    assert [b[0] for b in rows] == sorted(b[0] for b in rows)  # micro-batches in order of their first row


def _text_batch(lengths: list[int]) -> TrainBatch:
    trajs = [
        Trajectory(turns=[Turn(0, 0, "message", 0, [40] * (n - 1), [41], [-1.0])], reward=float(i % 2))
        for i, n in enumerate(lengths)
    ]
    return TrainBatch.from_trajectories(trajs, None, group_size=1)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(2, 40), min_size=1, max_size=12),
    st.integers(1, 80),
    st.booleans(),
)
def test_micro_batches_cover_every_row_once_within_the_budget(
    lengths: list[int], budget: int, packed: bool
) -> None:
    """For any lengths and budget: every row once, batch order inside, micro-batches ordered by their
    first row, the budget held (padded: rows x longest; packed: real tokens) except by a lone row
    that is over it on its own."""
    batch = _text_batch(lengths)
    mbs = batch.micro_batches(budget, packed=packed)
    rows = [m.sample_ids.tolist() for m in mbs]
    assert sorted(r for b in rows for r in b) == list(range(len(lengths)))
    assert all(b == sorted(b) for b in rows) and [b[0] for b in rows] == sorted(b[0] for b in rows)
    for m, ids in zip(mbs, rows, strict=True):
        assert m.lengths.tolist() == [lengths[i] for i in ids]
        cost = sum(lengths[i] for i in ids) if packed else len(ids) * max(lengths[i] for i in ids)
        assert cost <= budget or (len(ids) == 1 and lengths[ids[0]] > budget)


def test_packed_micro_batches_fill_the_budget_with_real_tokens(batch: TrainBatch) -> None:
    budget = int(batch.lengths.max()) * 3
    padded, packed = batch.micro_batches(budget), batch.micro_batches(budget, packed=True)
    assert all(int(m.lengths.sum()) <= budget for m in packed)
    assert len(packed) <= len(padded)
    for m in packed:
        assert len(m.media["pixel_values"]) == len(m)  # media follow their rows


def test_to_and_cast_media(batch: TrainBatch) -> None:
    moved = batch.to("cpu")
    assert (
        moved is not batch
        and moved.media["pixel_values"].provenance == batch.media["pixel_values"].provenance
    )
    bf = batch.cast_media(torch.bfloat16)
    assert bf.media["pixel_values"].dtype == torch.bfloat16
    assert bf.media["image_grid_thw"].dtype == torch.int64
    assert bf.media["image_grid_thw"].provenance == batch.media["image_grid_thw"].provenance
    assert batch.media["pixel_values"].dtype == torch.float32  # original untouched
    assert bf.media_physical_nbytes < batch.media_physical_nbytes


def test_regression_cast_media_keeps_video_timing_float32(batch: TrainBatch) -> None:
    """The suffix rule cast ``video_second_per_grid`` (float seconds, no listed suffix) to bf16."""
    from dataclasses import replace

    timing = replace(batch, media={**batch.media, "video_second_per_grid": batch.media["pixel_values"]})
    bf = timing.cast_media(torch.bfloat16)
    assert bf.media["video_second_per_grid"].dtype == torch.float32
    assert bf.media["pixel_values"].dtype == torch.bfloat16
    unlisted = replace(batch, media={**batch.media, "some_new_key": batch.media["pixel_values"]})
    assert unlisted.cast_media(torch.bfloat16).media["some_new_key"].dtype == torch.float32


def test_regression_shared_media_never_mutated_in_place(batch: TrainBatch) -> None:
    segs = [s for v in batch.media.values() for s in v.segments]
    before = [s.clone() for s in segs]
    outs: list[TrainBatch] = [
        batch.repeat_interleave(3),
        *batch.shard(2),
        *batch.micro_batches(int(batch.lengths.max()) * 2),
        TrainBatch.cat([batch, batch]),
        batch.cast_media(torch.bfloat16),
        batch.to("cpu"),
    ]
    for o in outs:
        for v in o.media.values():
            dense = v.materialize()
            if dense is not None:
                dense.add_(1)
    for s, b in zip(segs, before, strict=True):
        assert torch.equal(s, b)


def test_batch_pickle5_sends_storage_out_of_band_once(batch: TrainBatch) -> None:
    rep = batch.repeat_interleave(4)
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(rep, protocol=5, buffer_callback=buffers.append)
    oob = sum(memoryview(b).nbytes for b in buffers)
    assert oob >= rep.media_physical_nbytes
    assert oob < rep.media_logical_nbytes / 3
    assert len(stream) < 64 * 1024
    back = pickle.loads(stream, buffers=buffers)
    assert isinstance(back, TrainBatch) and torch.equal(back.input_ids, rep.input_ids)
    assert back.media["pixel_values"].provenance == rep.media["pixel_values"].provenance
    assert torch.equal(back.media["pixel_values"].materialize(), rep.media["pixel_values"].materialize())
    assert back.metadata == rep.metadata
