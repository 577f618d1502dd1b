"""Media encoded once per unique item: the same loss and gradients as encoding every copy, less work.

Every test compares ``GRPOConfig.encoder_dedup`` on against off (the materialised path: G copies of
a group's pixels through the vision tower) on one batch: the loss and every parameter's gradient,
vision and audio towers included, must agree within fp32 tolerance, and ``encoder_segments`` must
count the unique items while ``encoder_refs`` counts every reference.
"""

from __future__ import annotations

import copy
import io
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_helpers import mp4_bytes, wav_bytes
from PIL import Image
from trainer_helpers import one_turn

from gymbridge.media import MediaItem
from gymbridge.models.tiny_omni import build_tiny_omni
from gymbridge.models.tiny_vlm import (
    AUDIO_END,
    AUDIO_START,
    VISION_END,
    VISION_START,
    build_tiny_vlm,
)
from gymbridge.tensors import MediaProcessor, PackedTensor, TrainBatch
from gymbridge.trainer.encoder import encoder_plan, unique_items
from gymbridge.trainer.grpo import GradientResult, GRPOConfig, GRPOTrainer, token_logprobs

_MIME = {"image": "image/png", "video": "video/mp4", "audio": "audio/wav"}


def png(color: tuple[int, int, int], size: tuple[int, int] = (56, 56)) -> MediaItem:
    buf = io.BytesIO()
    img = Image.new("RGB", size, color)
    img.putpixel((3, 5), (color[0] ^ 255, 7, 9))
    img.save(buf, format="PNG")
    return MediaItem.from_bytes(buf.getvalue(), "image", mime=_MIME["image"])


def media(modality: str, data: bytes) -> MediaItem:
    return MediaItem.from_bytes(data, modality, mime=_MIME[modality])


def build_batch(
    bundle: Any, rows_media: list[list[MediaItem]], group_size: int, *, dedup: bool = True
) -> TrainBatch:
    """One trajectory per entry of ``rows_media``: each medium between its boundary tokens, then text,
    then a 4-token completion; rewards vary inside each group (nonzero advantages)."""
    tok = bundle.tokenizer

    def tid(name: str) -> int:
        return int(tok.convert_tokens_to_ids(name))

    processor = MediaProcessor(bundle.processor)
    done = processor.process([m for row in rows_media for m in row])
    pad = {"image": bundle.image_token_id, "video": bundle.video_token_id}
    if hasattr(bundle, "audio_token_id"):
        pad["audio"] = bundle.audio_token_id
    trajs = []
    for i, row in enumerate(rows_media):
        prompt = [40, 41]
        for m in row:
            n = done[m.key].num_placeholders
            assert n is not None
            start, end = (AUDIO_START, AUDIO_END) if m.modality == "audio" else (VISION_START, VISION_END)
            prompt += [tid(start), *[pad[m.modality]] * n, tid(end), 42]
        gen = [60 + i % 3, 70 + (i // group_size) % 5, 80 + i % 7, bundle.eos_token_id]
        trajs.append(one_turn(prompt, gen, row, reward=float((i * 7) % 3), task=i // group_size, rollout=i))
    return TrainBatch.from_trajectories(trajs, processor, group_size=group_size, dedup=dedup)


def off_policy(model: Any, batch: TrainBatch) -> TrainBatch:
    """``batch`` whose old logprobs sit a little off the model's own (a nonzero loss, some clipping)."""
    with torch.no_grad():
        lp = token_logprobs(model, batch)
    noise = torch.linspace(-0.3, 0.3, lp.numel()).reshape(lp.shape)
    return replace(batch, logprobs=(lp + noise) * batch.loss_mask)


def gradients(model: Any, batch: TrainBatch, *, dedup: bool, max_tokens: int = 8192) -> GradientResult:
    trainer = GRPOTrainer(
        copy.deepcopy(model), GRPOConfig(encoder_dedup=dedup, micro_batch_max_tokens=max_tokens)
    )
    return trainer.compute_gradients(batch)


def assert_same_step(model: Any, on: GradientResult, off: GradientResult, towers: tuple[str, ...]) -> None:
    assert on.loss_sum != 0.0
    assert on.loss_sum == pytest.approx(off.loss_sum, rel=1e-5, abs=1e-7)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, on.grads, off.grads, strict=True):
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) <= 1e-5 * max(scale, 1e-3), name
    for tower in towers:  # the encoders did get gradient (a comparison of zeros proves nothing)
        assert any(float(g.abs().max()) > 0 for n, g in zip(names, on.grads, strict=True) if tower in n), (
            tower
        )


@pytest.fixture(scope="module")
def vlm() -> Any:
    return build_tiny_vlm(0)


def test_groups_sharing_one_image_encode_it_once_with_the_same_gradients(vlm: Any) -> None:
    g = 4
    images = [png((40, 90, 200)), png((200, 60, 20), size=(84, 56))]
    batch = off_policy(vlm.model, build_batch(vlm, [[images[r // g]] for r in range(2 * g)], g))
    patches: list[int] = []  # patch rows the vision tower encodes per forward
    results = []
    for dedup in (True, False):
        model = copy.deepcopy(vlm.model)
        model.model.visual.register_forward_hook(lambda m, args, out: patches.append(args[0].shape[0]))
        results.append(GRPOTrainer(model, GRPOConfig(encoder_dedup=dedup)).compute_gradients(batch))
    on, off = results
    assert_same_step(vlm.model, on, off, ("visual.",))
    per_image = 16 + 24  # 56x56: 4x4 patches; 84x56: 6x4 patches
    assert patches == [per_image, g * per_image]  # each image once, vs G times
    assert (on.encoder_segments, on.encoder_refs, on.encoder_dedup) == (2, 8, True)
    assert (off.encoder_segments, off.encoder_refs, off.encoder_dedup) == (8, 8, False)


def test_rows_with_several_images_some_shared_across_groups(vlm: Any) -> None:
    g = 3
    shared = png((10, 220, 10))
    own = [png((120, 30 * k, 90)) for k in range(2)]
    rows = []
    for r in range(2 * g):
        group = r // g
        # the group's image twice, the image every group shares, and one of the row's own in some rows
        row = [own[group], shared, own[group]] + ([png((r * 30, 5, 200), size=(56, 84))] if r % 2 else [])
        rows.append(row)
    batch = off_policy(vlm.model, build_batch(vlm, rows, g))
    on, off = gradients(vlm.model, batch, dedup=True), gradients(vlm.model, batch, dedup=False)
    assert_same_step(vlm.model, on, off, ("visual.",))
    # 2 group images + 1 shared + 3 odd rows' own; references: 3 per row + 1 per odd row
    assert (on.encoder_segments, on.encoder_refs) == (6, 3 * 2 * g + g)
    assert off.encoder_segments == off.encoder_refs == 3 * 2 * g + g


def test_micro_batches_each_encode_their_own_unique_items(vlm: Any) -> None:
    g = 4
    images = [png((40, 90, 200)), png((200, 60, 20))]
    batch = off_policy(vlm.model, build_batch(vlm, [[images[r // g]] for r in range(2 * g)], g))
    length = batch.seq_len
    on = gradients(vlm.model, batch, dedup=True, max_tokens=3 * length)  # 3 rows per micro-batch
    off = gradients(vlm.model, batch, dedup=False, max_tokens=3 * length)
    assert_same_step(vlm.model, on, off, ("visual.",))
    assert on.encoder_refs == 8 and on.encoder_dedup
    # rows 0-2 | 3-5 | 6-7: group 0, groups 0+1, group 1
    assert on.encoder_segments == 4


def test_a_batch_built_without_dedup_encodes_every_copy_and_agrees(vlm: Any) -> None:
    g = 4
    image = png((40, 90, 200))
    batch = off_policy(vlm.model, build_batch(vlm, [[image]] * g, g, dedup=False))
    on, off = gradients(vlm.model, batch, dedup=True), gradients(vlm.model, batch, dedup=False)
    assert_same_step(vlm.model, on, off, ("visual.",))
    assert on.encoder_segments == on.encoder_refs == g and on.encoder_dedup  # nothing to merge


def _forward_both_ways(vlm: Any, *, dedup: bool) -> tuple[torch.Tensor, torch.Tensor]:
    batch = build_batch(vlm, [[png((40, 90, 200))]] * 4, 4, dedup=dedup)
    with torch.no_grad():
        on = token_logprobs(vlm.model, batch, encoder_dedup=True)
        off = token_logprobs(vlm.model, batch, encoder_dedup=False)
    return on, off


def test_the_forward_is_bit_identical_when_every_reference_is_its_own_item(vlm: Any) -> None:
    """The outside route (``mm_encoder_outputs``) itself changes nothing: the same rows encoded."""
    on, off = _forward_both_ways(vlm, dedup=False)
    assert torch.equal(on, off)


def test_regression_shared_items_agree_within_fp32_rounding_not_bit_for_bit(vlm: Any) -> None:
    """Four rows sharing one image: the encoder's matrix products run on a quarter of the rows, and
    the BLAS may block those shapes differently. Bit identity held on AVX2 machines and broke on an
    AVX-512 one (MKL: 4.8e-7 apart, whatever the transformers release); the promise is fp32 rounding."""
    on, off = _forward_both_ways(vlm, dedup=True)
    assert float(off.abs().max()) > 1.0  # real logprobs, not a comparison of zeros
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-6)


class _NoHook(torch.nn.Module):
    """A policy whose forward takes pixels only (no ``mm_encoder_outputs``): the materialised path runs."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
    ) -> Any:
        return self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            mm_token_type_ids=mm_token_type_ids,
        )


def test_a_model_without_the_hook_falls_back_logged_and_reports_it(
    vlm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    g = 4
    batch = off_policy(vlm.model, build_batch(vlm, [[png((40, 90, 200))]] * g, g))
    wrapped = _NoHook(copy.deepcopy(vlm.model))
    assert encoder_plan(wrapped, batch.media) == "_NoHook has no get_image_features"
    with caplog.at_level(logging.INFO, logger="gymbridge.trainer.encoder"):
        res = GRPOTrainer(wrapped, GRPOConfig(encoder_dedup=True)).compute_gradients(batch)
    assert "_NoHook has no get_image_features" in caplog.text
    assert (res.encoder_segments, res.encoder_refs, res.encoder_dedup) == (g, g, False)
    off = gradients(vlm.model, batch, dedup=False)
    assert res.loss_sum == pytest.approx(off.loss_sum, rel=1e-6)


def test_media_of_unknown_modality_or_without_their_grids_fall_back(vlm: Any) -> None:
    batch = build_batch(vlm, [[png((40, 90, 200))]] * 2, 2)
    extra = dict(batch.media, image_sizes=PackedTensor.from_rows([[torch.ones(1, 2)]] * 2))
    assert encoder_plan(vlm.model, extra) == "media keys of unknown modality ['image_sizes']"
    pixels_only = {"pixel_values": batch.media["pixel_values"]}
    assert encoder_plan(vlm.model, pixels_only) == "image key 'pixel_values' comes without ['image_grid_thw']"


def test_step_metrics_carry_the_encoder_counts(vlm: Any) -> None:
    g = 4
    batch = off_policy(vlm.model, build_batch(vlm, [[png((40, 90, 200))]] * g, g))
    metrics = GRPOTrainer(copy.deepcopy(vlm.model), on_policy=False).step(batch).as_dict()
    assert (metrics["encoder_segments"], metrics["encoder_refs"], metrics["encoder_dedup"]) == (1, g, True)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), max_size=4), min_size=1, max_size=6),
    st.lists(st.integers(1, 3), min_size=5, max_size=5),
)
def test_gathering_unique_items_by_inverse_rebuilds_every_reference(
    rows: list[list[int]], sizes: list[int]
) -> None:
    """Property: item blocks picked by ``inverse`` concatenate to the materialised tensor, for any sharing."""
    pixels = [torch.full((4 * sizes[k], 3), float(k)) + torch.arange(3.0) for k in range(5)]
    grids = [torch.tensor([[1, 2, 2 * sizes[k]]]) for k in range(5)]
    prov = [[f"p{k}" for k in row] for row in rows]
    packs = {
        "pixel_values": PackedTensor.from_rows([[pixels[k] for k in row] for row in rows], prov),
        "image_grid_thw": PackedTensor.from_rows(
            [[grids[k] for k in row] for row in rows], [[f"g{k}" for k in row] for row in rows]
        ),
    }
    found = unique_items("image", packs)
    if not any(rows):
        assert found == "no image references"
        return
    assert not isinstance(found, str)
    assert found.num_items == len({k for row in rows for k in row}) and found.num_refs == sum(map(len, rows))
    lengths = found.inputs["image_grid_thw"].prod(dim=-1).tolist()
    blocks = torch.split(found.inputs["pixel_values"], lengths)
    rebuilt = torch.cat([blocks[u] for u in found.inverse.tolist()])
    assert torch.equal(rebuilt, packs["pixel_values"].materialize())
    grids_rebuilt = found.inputs["image_grid_thw"][found.inverse]
    assert torch.equal(grids_rebuilt, packs["image_grid_thw"].materialize())


def test_keys_that_disagree_on_their_references_are_not_merged() -> None:
    pix = PackedTensor.from_rows([[torch.ones(4, 3)], [torch.ones(4, 3)]], [["a"], ["a"]])
    grid = PackedTensor.from_rows([[torch.tensor([[1, 2, 2]])], []], [["g"], []])
    reason = unique_items("image", {"pixel_values": pix, "image_grid_thw": grid})
    assert reason == "image keys 'pixel_values' and 'image_grid_thw' disagree on their references per row"


@pytest.fixture(scope="module")
def omni() -> Any:
    return build_tiny_omni(0)


def test_omni_images_video_and_audio_each_encoded_once_with_the_same_gradients(omni: Any) -> None:
    g = 3
    shared_audio = media("audio", wav_bytes(seconds=1.0))
    video = media("video", mp4_bytes(num_frames=4))
    images = [png((200, 30, 30)), png((30, 30, 200))]
    own_audio = media("audio", wav_bytes(seconds=0.6, freq_hz=440.0))
    rows = []
    for r in range(2 * g):
        row = [images[r // g], shared_audio, video]
        if r == 1:
            row.append(own_audio)
        rows.append(row)
    batch = off_policy(omni.model, build_batch(omni, rows, g))
    on, off = gradients(omni.model, batch, dedup=True), gradients(omni.model, batch, dedup=False)
    assert_same_step(omni.model, on, off, ("visual.", "audio_tower."))
    # items: 2 images + 1 video + 2 audio clips; references: 3 per row + row 1's own clip
    assert (on.encoder_segments, on.encoder_refs, on.encoder_dedup) == (5, 3 * 2 * g + 1, True)
    assert off.encoder_segments == off.encoder_refs == 3 * 2 * g + 1


@pytest.mark.integration
def test_smoke_run_reports_one_encoder_segment_per_unique_image(tmp_path: Path) -> None:
    """``gymbridge smoke run``, 2 steps of 2 prompts x G=4: ``encoder_segments`` is the unique images."""
    from gymbridge.cli import main

    run_dir = tmp_path / "run"
    argv = ["smoke", "run", "--native", "--steps", "2", "--prompts", "2", "--group-size", "4"]
    argv += ["--run-dir", str(run_dir), "--set", "rollout.max_tokens=16", "--set", "warmup.steps=0"]
    argv += ["--set", "shaping.kind=token_rate", "--no-progress"]
    assert main(argv) == 0
    records = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert any(r["skipped"] is None for r in records)
    for r in (r for r in records if r["skipped"] is None):
        assert r["encoder_dedup"] is True
        assert r["encoder_segments"] == len(r["media_keys"]) == 2  # one image per prompt
        assert r["encoder_refs"] == r["num_rows"] == 8  # every rollout row references its prompt's image
