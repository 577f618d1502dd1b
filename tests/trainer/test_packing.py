"""Sequence packing in the GRPO step: packed equals padded, with the model's own M-RoPE positions."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_helpers import media_batch, with_current_logprobs

from gymbridge.errors import ConfigError
from gymbridge.media import MediaItem
from gymbridge.models.tiny_omni import TinyOmni
from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.tensors import TrainBatch
from gymbridge.trainer import GradientResult, GRPOConfig, GRPOTrainer, packing, tiny_policy, token_logprobs
from gymbridge.trainer.forward import forward_kwargs as _forward_kwargs
from gymbridge.trainer.models import tiny_omni_policy
from gymbridge.trainer.packing import PackedRows, check_packable, packed_forward_kwargs, rope_position_ids

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from omni_helpers import mp4_bytes, png_bytes, wav_bytes  # noqa: E402

BUDGET = 90  # tokens per forward pass: the VLM batch below needs several micro-batches either way


def _image(color: tuple[int, int, int], size: int = 56) -> MediaItem:
    return MediaItem.from_bytes(png_bytes(color, size), "image", mime="image/png")


@pytest.fixture(scope="module")
def vlm_batch(tiny: TinyVLM) -> TrainBatch:
    """Six rows of different lengths: one image, two images (one 112 px), none, another image, ..."""
    red, blue, big = _image((200, 30, 30)), _image((20, 40, 220)), _image((20, 130, 30), 112)
    rows = [([red], 3), ([red, big], 8), ([], 5), ([blue], 12), ([big], 2), ([], 9)]
    return media_batch(tiny.tokenizer, tiny.processor, rows)


@pytest.fixture(scope="module")
def omni_batch(tiny_omni: TinyOmni) -> TrainBatch:
    img, wide = _image((200, 30, 30)), _image((20, 130, 30), 112)
    clip = MediaItem.from_bytes(wav_bytes(1.0), "audio", mime="audio/wav")
    video = MediaItem.from_bytes(mp4_bytes(), "video", mime="video/mp4")
    rows = [([img], 5), ([clip], 9), ([video], 3), ([], 7), ([wide, clip], 4), ([img], 6)]
    return media_batch(tiny_omni.tokenizer, tiny_omni.processor, rows)


def _off_policy(model: Any, batch: TrainBatch) -> TrainBatch:
    """``batch`` with generation logprobs a little off the model's (nonzero loss, some clipping)."""
    with torch.no_grad():
        lp = token_logprobs(model, batch)
    wobble = 0.3 * torch.sin(torch.arange(batch.seq_len, dtype=torch.float32))[None]
    return replace(batch, logprobs=(lp + wobble) * batch.loss_mask)


def _gradients(model: Any, batch: TrainBatch, **cfg: Any) -> GradientResult:
    return GRPOTrainer(model, GRPOConfig(**cfg), on_policy=False).compute_gradients(batch)


def _assert_same_step(a: GradientResult, b: GradientResult) -> None:
    assert b.loss_sum == pytest.approx(a.loss_sum, abs=1e-6)
    assert (b.loss_tokens, b.clipped_tokens) == (a.loss_tokens, a.clipped_tokens)
    assert b.ratio_sum == pytest.approx(a.ratio_sum, rel=1e-6)
    assert any(float(g.abs().sum()) > 0 for g in a.grads)
    for x, y in zip(a.grads, b.grads, strict=True):
        torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_loss_and_gradients_equal_the_padded_step(
    tiny: TinyVLM, vlm_batch: TrainBatch, attn: str
) -> None:
    model = tiny_policy(0)
    model.set_attn_implementation(attn)
    batch = _off_policy(model, vlm_batch)
    with torch.no_grad():
        padded = token_logprobs(model, batch)
        packed = token_logprobs(model, batch, packed=True)
    assert float((padded * batch.loss_mask).abs().sum()) > 0
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    ref = _gradients(model, batch, micro_batch_max_tokens=BUDGET)
    got = _gradients(model, batch, micro_batch_max_tokens=BUDGET, sequence_packing=True)
    assert got.packed_sequences >= 2 and ref.packed_sequences == 0  # several packed sequences were run
    assert abs(ref.loss_sum) > 1e-3
    _assert_same_step(ref, got)


def test_packing_with_top_p_kl_and_seq_mean_equals_the_padded_step(
    tiny: TinyVLM, vlm_batch: TrainBatch
) -> None:
    """Regression for the merge of packing with the GRPO variants: the nucleus is taken at the packed
    loss positions, the reference scores the same packed sequence, seq-mean rows stay rows, and
    the entropy bonus reads the packed loss positions too."""
    model = tiny_policy(0)
    batch = _off_policy(model, vlm_batch)
    variants = {"top_p": 0.9, "kl_coef": 0.1, "loss_agg": "seq_mean_token_mean", "entropy_coef": 0.05}

    def gradients(**cfg: Any) -> GradientResult:
        trainer = GRPOTrainer(
            model, GRPOConfig(micro_batch_max_tokens=BUDGET, **variants, **cfg), on_policy=False
        )
        assert trainer.reference is not None
        with torch.no_grad():  # a reference away from the policy: a nonzero KL term
            for i, p in enumerate(trainer.reference.parameters()):
                p.add_(0.02 * torch.sin(torch.arange(p.numel(), dtype=p.dtype) + i).reshape(p.shape))
        return trainer.compute_gradients(batch)

    ref, got = gradients(), gradients(sequence_packing=True)
    assert got.packed_sequences >= 2
    assert got.outside_top_p_tokens == ref.outside_top_p_tokens
    assert abs(ref.ref_kl_sum) > 1e-4
    assert got.ref_kl_sum == pytest.approx(ref.ref_kl_sum, rel=1e-4)
    assert ref.entropy_sum is not None and ref.entropy_sum > 1e-3
    assert got.entropy_sum == pytest.approx(ref.entropy_sum, rel=1e-4)
    _assert_same_step(ref, got)


def test_one_d_positions_would_not_match_the_padded_step(
    tiny: TinyVLM, vlm_batch: TrainBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The equality above needs Qwen2-VL's M-RoPE: packed with 1-D positions (arange per row), the
    rows with images get other logprobs, the text-only rows the same."""
    model = tiny_policy(0)
    with torch.no_grad():
        padded = token_logprobs(model, vlm_batch)
        monkeypatch.setattr(packing, "rope_position_ids", lambda model, kwargs: None)
        one_d = token_logprobs(model, vlm_batch, packed=True)
    diff = (one_d - padded).abs().amax(dim=1)
    has_image = (vlm_batch.input_ids == tiny.image_token_id).any(dim=1)
    assert bool((diff[has_image] > 1e-3).all()), diff
    assert bool((diff[~has_image] < 1e-5).all()), diff


def test_packed_positions_are_each_rows_own_m_rope(tiny: TinyVLM, vlm_batch: TrainBatch) -> None:
    """Row ``b``'s slice of the packed positions is ``get_rope_index`` of row ``b`` alone (its own ids,
    grids and mask); for rows with an image that is not ``arange``."""
    model = tiny_policy(0)
    kwargs, rows = packed_forward_kwargs(model, _forward_kwargs(model, vlm_batch))
    positions = kwargs["position_ids"]
    assert positions.shape == (3, 1, vlm_batch.num_tokens)
    assert kwargs["input_ids"].shape == (1, vlm_batch.num_tokens)
    for b in range(len(vlm_batch)):
        alone = vlm_batch.select([b]).trim()
        own = rope_position_ids(model, _forward_kwargs(model, alone))
        n, start = int(rows.lengths[b]), int(rows.starts[b])
        mine = positions[:, 0, start : start + n]
        if own is None:  # no media in the row: the model's own positions are 1-D
            own = torch.arange(n).expand(3, 1, n)
        assert torch.equal(mine, own[:, 0]), b
        images = bool((alone.input_ids == tiny.image_token_id).any())
        assert torch.equal(mine, torch.arange(n).expand(3, n)) != images, b


def test_rows_of_a_packed_sequence_do_not_see_each_other(tiny: TinyVLM, vlm_batch: TrainBatch) -> None:
    model = tiny_policy(0)
    ids = vlm_batch.input_ids.clone()
    ids[0, 1:4] = torch.tensor([50, 51, 52])  # row 0's text changes
    changed = replace(vlm_batch, input_ids=ids)
    with torch.no_grad():
        a = token_logprobs(model, vlm_batch, packed=True)
        b = token_logprobs(model, changed, packed=True)
    assert not torch.allclose(a[0], b[0])
    torch.testing.assert_close(a[1:], b[1:], atol=1e-6, rtol=1e-6)


def test_packed_omni_thinker_with_image_audio_and_video_rows_equals_padded(
    tiny_omni: TinyOmni, omni_batch: TrainBatch
) -> None:
    """Qwen2.5-Omni's ``get_rope_index`` takes audio lengths and video timing too: packing covers it."""
    model = tiny_omni_policy(0)
    check_packable(model)
    assert {"input_features", "pixel_values_videos", "pixel_values"} <= set(omni_batch.media)
    batch = _off_policy(model, omni_batch)
    with torch.no_grad():
        padded = token_logprobs(model, batch)
        packed = token_logprobs(model, batch, packed=True)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    ref = _gradients(model, batch, micro_batch_max_tokens=100)
    got = _gradients(model, batch, micro_batch_max_tokens=100, sequence_packing=True)
    assert got.packed_sequences >= 2
    _assert_same_step(ref, got)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_row_longer_than_the_budget_trains_in_a_micro_batch_of_its_own(
    tiny: TinyVLM, vlm_batch: TrainBatch, packed: bool
) -> None:
    """Regression: a row over ``micro_batch_max_tokens`` used to fail the whole step (ValueError)."""
    model = tiny_policy(0)
    batch = _off_policy(model, vlm_batch)
    longest = int(batch.lengths.max())
    whole = _gradients(model, batch, micro_batch_max_tokens=10_000, sequence_packing=packed)
    trainer = GRPOTrainer(
        model, GRPOConfig(micro_batch_max_tokens=longest - 5, sequence_packing=packed), on_policy=False
    )
    tight = trainer.compute_gradients(batch)
    _assert_same_step(whole, tight)
    if packed:
        assert whole.packed_sequences == 1 and tight.packed_sequences > 1
    assert trainer.apply_gradients(tight.grads) > 0 and trainer.steps == 1  # the step goes through


def test_step_metrics_show_packing(tiny: TinyVLM, vlm_batch: TrainBatch) -> None:
    model = tiny_policy(0)
    batch = with_current_logprobs(model, vlm_batch)
    padded = GRPOTrainer(tiny_policy(0), GRPOConfig(micro_batch_max_tokens=BUDGET)).step(batch)
    packed = GRPOTrainer(
        tiny_policy(0), GRPOConfig(micro_batch_max_tokens=BUDGET, sequence_packing=True)
    ).step(batch)
    n_packed = len(batch.micro_batches(BUDGET, packed=True))
    assert (packed.packed_sequences, packed.padding_fraction) == (n_packed, 0.0)
    run = sum(len(m) * m.seq_len for m in batch.micro_batches(BUDGET))
    assert padded.packed_sequences == 0
    assert (
        padded.padding_fraction == pytest.approx((run - batch.num_tokens) / run)
        and padded.padding_fraction > 0
    )
    assert {"packed_sequences", "padding_fraction"} <= set(packed.as_dict())
    assert packed.loss == pytest.approx(padded.loss, abs=1e-6)
    assert packed.grad_norm == pytest.approx(padded.grad_norm, rel=1e-4)


class _FakePolicy(torch.nn.Module):
    def __init__(self, attn: str, layer_types: list[str] | None = None, rope: Any = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(_attn_implementation=attn, layer_types=layer_types)
        if rope is not None:
            self.get_rope_index = rope

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> Any:
        raise AssertionError("never run")


def test_packing_refuses_a_model_it_cannot_run_exactly() -> None:
    check_packable(_FakePolicy("sdpa", ["full_attention"] * 2))  # runs
    check_packable(_FakePolicy("flash_attention_2"))  # the position-id route
    with pytest.raises(ConfigError, match="attention implementation 'paged_attention'"):
        GRPOTrainer(_FakePolicy("paged_attention"), GRPOConfig(sequence_packing=True))
    with pytest.raises(ConfigError, match="sliding_attention"):
        check_packable(_FakePolicy("sdpa", ["full_attention", "sliding_attention"]))

    def rope(input_ids: torch.Tensor, depth_map: torch.Tensor) -> Any:
        raise AssertionError("never run")

    with pytest.raises(ConfigError, match=r"get_rope_index needs \['depth_map'\]"):
        check_packable(_FakePolicy("sdpa", rope=rope))
    GRPOTrainer(_FakePolicy("paged_attention"), GRPOConfig())  # packing off: nothing checked


@st.composite
def _masks(draw: Any) -> torch.Tensor:
    lengths = draw(st.lists(st.integers(0, 7), min_size=1, max_size=5))
    width = max(max(lengths), 1) + draw(st.integers(0, 2))
    return torch.tensor([[1] * n + [0] * (width - n) for n in lengths])


@settings(max_examples=60, deadline=None)
@given(_masks())
def test_packed_rows_round_trip_and_mask_against_a_reference(mask: torch.Tensor) -> None:
    rows = PackedRows.of(mask)
    values = torch.arange(mask.numel(), dtype=torch.float32).reshape(mask.shape) + 1
    packed = rows.pack(values)
    assert packed.shape == (1, int(mask.sum()))
    expect = [float(values[b, t]) for b in range(mask.shape[0]) for t in range(int(mask[b].sum()))]
    assert packed[0].tolist() == expect  # rows in order, tokens in order
    back = rows.unpack(packed)
    keep = mask.clone()
    keep[:, 0] = 0  # a row's first token has no logprob
    assert torch.equal(back, values * keep)
    owner = [b for b in range(mask.shape[0]) for _ in range(int(mask[b].sum()))]
    ref = torch.tensor(
        [[owner[q] == owner[k] and k <= q for k in range(len(owner))] for q in range(len(owner))]
    )
    assert torch.equal(rows.causal_mask()[0, 0], ref.reshape(len(owner), len(owner)))
    additive = rows.causal_mask(additive_dtype=torch.float32)[0, 0]
    assert torch.equal(additive == 0, ref.reshape(len(owner), len(owner)))


@pytest.mark.integration
def test_smoke_run_with_sequence_packing_trains_and_reports_it(tmp_path: Path) -> None:
    """``gymbridge smoke run --set trainer.sequence_packing=true``: the step runs packed sequences, the
    generator's logprobs are reproduced by the packed forward (ratio 1: the positions are the
    model's), the policy moves, and ``metrics.jsonl`` shows the packing."""
    import orjson

    from gymbridge import cli

    run_dir = tmp_path / "run"
    argv = ["smoke", "run", "--native", "--prompts", "1", "--group-size", "8", "--steps", "2"]
    for key in ("rollout.max_tokens=12", "warmup.steps=0", "shaping.kind=token_rate"):
        argv += ["--set", key]
    argv += ["--set", "trainer.sequence_packing=true", "--set", "trainer.micro_batch_max_tokens=200"]
    argv += ["--set", "output.payload_metrics=false", "--run-dir", str(run_dir), "--no-progress"]
    assert cli.main(argv) == 0
    recs = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        # 8 rows of ~70 tokens under a 200-token budget: several packed sequences, no padding run
        assert r["packed_sequences"] >= 3 and r["padding_fraction"] == 0.0, r
        assert r["skipped"] is None and r["grad_norm"] > 0 and r["num_loss_tokens"] > 0, r
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-4), r


def test_dp_shards_packed_by_their_own_trainers_sum_to_the_padded_gradient(
    tiny: TinyVLM, vlm_batch: TrainBatch
) -> None:
    """A DP worker builds its ``GRPOTrainer`` from the driver's GRPOConfig (``ray_dp.DPWorker``), so
    each packs its own shard; the shards' gradients still sum to the whole batch's padded gradient,
    and the step metrics add up the shards' packing."""
    import functools

    from gymbridge.trainer import from_config, summarize

    model = tiny_policy(0)
    batch = _off_policy(model, vlm_batch)
    factory = functools.partial(from_config, type(model), model.config)
    cfg = GRPOConfig(micro_batch_max_tokens=60, sequence_packing=True)
    total = int(batch.loss_mask.sum())
    parts = []
    for shard in batch.shard(2):
        worker_model = factory()
        worker_model.load_state_dict(model.state_dict())
        parts.append(GRPOTrainer(worker_model, cfg).compute_gradients(shard, total_loss_tokens=total))
    ref = _gradients(model, batch, micro_batch_max_tokens=60)
    assert sum(p.loss_sum for p in parts) == pytest.approx(ref.loss_sum, abs=1e-6)
    for i, want in enumerate(ref.grads):
        torch.testing.assert_close(parts[0].grads[i] + parts[1].grads[i], want, atol=1e-6, rtol=1e-4)
    metrics = summarize(batch, parts, 0.0, 0.0)
    assert metrics.packed_sequences == sum(p.packed_sequences for p in parts) >= 2
    assert metrics.padding_fraction == 0.0
