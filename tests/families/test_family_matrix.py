"""Every model-dependent path on every tiny family: family x {image in the prompt, tool image after turn 0}.

For each cell (:mod:`family_helpers`: two GRPO groups of three native episodes) a user would notice:

* each turn's media match its placeholders (one block per item, in the family's expansion), and
  the processor's per-item count is what the prompt holds;
* the trainer's teacher-forced logprobs reproduce the generator's (< 1e-5, fp32) with media
  deduplicated or not, encoded once per item or per reference, padded or packed (the family's
  positions and masks);
* loss and every gradient are the same with dedup on and off and with the encoder path on and off,
  and the encoder path did run (``encoder_dedup``, one encoding per unique item);
* the gradients of DP shards (bf16-cast media included where the key is floating) add up to the
  whole batch's;
* the prompt sent to vLLM holds one placeholder per item in the family's form, and the family's own
  processor expands it back to the recorded prompt.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
from family_helpers import CASES, FAMILIES, GROUP_SIZE, TEMPERATURE, VIDEO_FAMILIES, Rollouts, rollouts

from gymbridge.families import family_of
from gymbridge.generation.vllm import collapse_placeholders
from gymbridge.tensors import MediaProcessor, TrainBatch
from gymbridge.trainer.grpo import GradientResult, GRPOConfig, GRPOTrainer, token_logprobs
from gymbridge.trainer.ray_dp import policy_shards
from gymbridge.trajectory.checks import check_media_placeholders, count_placeholders

pytestmark = pytest.mark.integration

CELLS = [pytest.param(f, c, id=f"{f}-{c}") for f in FAMILIES for c in CASES] + [
    pytest.param(f, "tool_video", id=f"{f}-tool_video") for f in VIDEO_FAMILIES
]


def batch_of(r: Rollouts, *, dedup: bool = True) -> TrainBatch:
    return TrainBatch.from_trajectories(
        r.trajectories, MediaProcessor(r.tiny.processor), group_size=GROUP_SIZE, dedup=dedup
    )


def off_policy(model: Any, batch: TrainBatch) -> TrainBatch:
    """``batch`` with old logprobs a little off the model's own: a nonzero loss with some clipping."""
    with torch.no_grad():
        lp = token_logprobs(model, batch, temperature=TEMPERATURE)
    noise = torch.linspace(-0.3, 0.3, lp.numel()).reshape(lp.shape)
    return replace(batch, logprobs=(lp + noise) * batch.loss_mask)


def gradients(model: Any, batch: TrainBatch, **config: Any) -> GradientResult:
    trainer = GRPOTrainer(copy.deepcopy(model), GRPOConfig(temperature=TEMPERATURE, **config))
    return trainer.compute_gradients(batch)


def assert_same_gradients(model: Any, a: GradientResult, b: GradientResult) -> None:
    assert a.loss_sum != 0.0
    assert a.loss_sum == pytest.approx(b.loss_sum, rel=1e-5, abs=1e-7)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    vision = 0.0
    for name, x, y in zip(names, a.grads, b.grads, strict=True):
        assert float((x - y).abs().max()) <= 1e-5 * max(float(y.abs().max()), 1e-3), name
        if any(part in name for part in ("visual", "vision")):
            vision = max(vision, float(x.abs().max()))
    assert vision > 0  # the vision encoder got gradient (a comparison of zeros proves nothing)


@pytest.mark.parametrize(("family", "case"), CELLS)
def test_each_turns_media_match_its_placeholders(family: str, case: str) -> None:
    r = rollouts(family, case)
    ids = r.tiny.placeholder_token_ids
    later = {"prompt_image": [], "tool_image": ["image"], "tool_video": ["video"]}[case]
    for traj in r.trajectories:
        check_media_placeholders(traj, ids)  # one run of placeholders per item, turn by turn
        # the prompt's image on turn 0, the tool's medium on turn 1
        assert [[m.modality for m in t.media] for t in traj.turns] == [["image"]] + [[m] for m in later]
    processor = MediaProcessor(r.tiny.processor)
    for modality in ("image", *later):
        assert processor.placeholder_token_id(modality) == ids[modality]
    for inp in r.inputs_seen:  # every call's prompt holds exactly what its media need
        counts = processor.process(list(inp.media))
        for modality in {m.modality for m in inp.media}:
            mine = [m for m in inp.media if m.modality == modality]
            want = sum(int(counts[m.key].num_placeholders or 0) for m in mine)
            assert want > 0 and inp.prompt_token_ids.count(ids[modality]) == want
            assert count_placeholders(inp.prompt_token_ids, ids[modality]) == len(mine)
    batch_of(r)  # the batch's own per-turn check passes too


@pytest.mark.parametrize(("family", "case"), CELLS)
def test_trainer_logprobs_equal_the_generators(family: str, case: str) -> None:
    r = rollouts(family, case)
    model = r.tiny.model
    mask_ok = False
    for dedup in (True, False):
        batch = batch_of(r, dedup=dedup)
        mask = batch.loss_mask > 0
        mask_ok = bool(mask.any())
        for encoder in (True, False):
            for packed in (False, True):
                with torch.no_grad():
                    new = token_logprobs(
                        model, batch, temperature=TEMPERATURE, encoder_dedup=encoder, packed=packed
                    )
                diff = float((new[mask] - batch.logprobs[mask]).abs().max())
                assert diff < 1e-5, (dedup, encoder, packed, diff)
    assert mask_ok


@pytest.mark.parametrize(("family", "case"), CELLS)
def test_loss_and_gradients_are_equal_with_dedup_and_the_encoder_path_on_and_off(
    family: str, case: str
) -> None:
    r = rollouts(family, case)
    model = r.tiny.model
    reference = off_policy(model, batch_of(r, dedup=True))
    results = {}
    for dedup in (True, False):
        batch = reference if dedup else replace(batch_of(r, dedup=False), logprobs=reference.logprobs)
        for encoder in (True, False):
            results[dedup, encoder] = gradients(model, batch, encoder_dedup=encoder)
    base = results[False, False]
    for key, result in results.items():
        assert_same_gradients(model, result, base)
        assert result.encoder_dedup == key[1]  # the family's encoder hook ran (no fallback)
    # dedup on: each unique medium encoded once (two groups: two prompt images, and the tool's media)
    media = [m for t in r.trajectories for turn in t.turns for m in turn.media]
    assert results[True, True].encoder_segments == len({m.key for m in media})
    assert results[True, True].encoder_refs == results[True, False].encoder_segments == len(media)


@pytest.mark.parametrize(("family", "case"), CELLS)
def test_packed_gradients_equal_the_padded_ones(family: str, case: str) -> None:
    r = rollouts(family, case)
    batch = off_policy(r.tiny.model, batch_of(r))
    padded = gradients(r.tiny.model, batch)
    packed = gradients(r.tiny.model, batch, sequence_packing=True)
    assert packed.packed_sequences >= 1
    assert_same_gradients(r.tiny.model, packed, padded)


@pytest.mark.parametrize("family", FAMILIES)
def test_dp_shards_with_cast_media_add_up_to_the_whole_batch(family: str) -> None:
    r = rollouts(family, "tool_image")
    model = r.tiny.model
    batch = off_policy(model, batch_of(r))
    whole = gradients(model, batch)
    shards = policy_shards(batch, 2, torch.float32)
    assert len(shards) == 2 and all(len(s) == GROUP_SIZE for s in shards)  # whole groups per shard
    tokens, rows = int(batch.loss_mask.sum()), int((batch.loss_mask.sum(dim=1) > 0).sum())
    trainer = GRPOTrainer(copy.deepcopy(model), GRPOConfig(temperature=TEMPERATURE))
    parts = [trainer.compute_gradients(s, total_loss_tokens=tokens, total_loss_rows=rows) for s in shards]
    grads = [torch.stack(g).sum(dim=0) for g in zip(*(p.grads for p in parts), strict=True)]
    summed = GradientResult(grads, sum(p.loss_sum for p in parts), 0, 0, 0.0, 0.0)
    assert_same_gradients(model, summed, whole)
    # bf16 by key: pixels are cast (they feed the encoder), grids / counts keep their integer dtype
    cast = batch.cast_media(torch.bfloat16)
    for key, pack in cast.media.items():
        want = torch.bfloat16 if key in ("pixel_values", "pixel_values_videos") else batch.media[key].dtype
        assert pack.dtype == want, key
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        lp = token_logprobs(bf16, cast, temperature=TEMPERATURE)
    mask = batch.loss_mask > 0
    assert bool(torch.isfinite(lp).all()) and float((lp[mask] - batch.logprobs[mask]).abs().mean()) < 0.5


@pytest.mark.parametrize(("family", "case"), CELLS)
def test_vllm_prompt_has_one_placeholder_per_item_and_expands_back(family: str, case: str) -> None:
    r = rollouts(family, case)
    config, processor = r.tiny.model.config, r.tiny.processor
    fam = family_of(config)
    tokenizer = r.tiny.tokenizer
    for inp in r.inputs_seen:
        data = {m: list(v) for m, v in inp.multi_modal_data.items()}
        short = collapse_placeholders(
            inp.prompt_token_ids,
            {m: len(v) for m, v in data.items()},
            fam.placeholder_ids(config),
            family=fam,
            hf_config=config,
            tokenizer=tokenizer,
        )
        text = tokenizer.decode(short, skip_special_tokens=False)
        for modality, items in data.items():
            placeholder = fam.placeholder_text(processor, modality)
            assert placeholder is not None and text.count(placeholder) == len(items)
        # what vLLM's processor does with it: the family's processor expands each placeholder again
        kwargs: dict[str, Any] = {"images": [data["image"]] if family == "gemma3" else data["image"]}
        if "video" in data:
            kwargs["videos"] = data["video"]
        again = processor(text=[text], add_special_tokens=False, return_tensors="pt", **kwargs)
        assert again["input_ids"][0].tolist() == list(inp.prompt_token_ids)
