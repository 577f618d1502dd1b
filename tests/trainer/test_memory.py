"""Memory where it matters (:mod:`gymbridge.trainer.memory`, docs/memory.md): what a user would notice.

* activation checkpointing gives the same gradients (fp32) and keeps every parameter name;
* a frozen vision / audio tower gets no gradient and does not move; the trainable count drops;
* the trainer's lean logits (output head at loss positions only) equal the full path's there, for
  every tiny family, padded and packed, with top-p and entropy; other positions hold 0;
* bf16 training keeps fp32 master weights: an AdamW update at lr 1e-6 survives;
* a run with the settings on says so and trains.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from families.family_helpers import GROUP_SIZE, TEMPERATURE, rollouts
from run.run_helpers import SMALL, quiet_train, run_config

from gymbridge.models.tiny_families import TINY_FAMILIES, tiny_family_policy
from gymbridge.tensors import MediaProcessor, TrainBatch
from gymbridge.trainer import forward
from gymbridge.trainer.checkpoint import load_checkpoint, save_checkpoint
from gymbridge.trainer.grpo import GRPOConfig, GRPOTrainer, token_logprobs
from gymbridge.trainer.memory import (
    apply_activation_checkpointing,
    autocast_dtype,
    checkpointed_blocks,
    enable_autocast,
    freeze_encoders,
    prepare_policy,
    trainable_parameters,
)

pytestmark = pytest.mark.integration

CASE = {"qwen2_5_omni": "tool_video"}
"""Each family's episodes: an image in the prompt and a tool image (the omni thinker: a tool video)."""

ENCODERS = {
    "qwen2_vl": ("model.visual",),
    "qwen2_5_vl": ("model.visual",),
    "qwen3_vl": ("model.visual",),
    "gemma3": ("model.vision_tower",),
    "internvl": ("model.vision_tower",),
    "qwen2_5_omni": ("model.audio_tower", "model.visual"),
}


def family_batch(family: str) -> tuple[Any, TrainBatch]:
    """A private copy of ``family``'s tiny model and a batch of its episodes with old logprobs a
    little off the model's own (a nonzero loss, some clipping)."""
    r = rollouts(family, CASE.get(family, "tool_image"))
    batch = TrainBatch.from_trajectories(
        r.trajectories, MediaProcessor(r.tiny.processor), group_size=GROUP_SIZE
    )
    model = copy.deepcopy(r.tiny.model)
    with torch.no_grad():
        lp = token_logprobs(model, batch, temperature=TEMPERATURE)
    noise = torch.linspace(-0.3, 0.3, lp.numel()).reshape(lp.shape)
    return model, replace(batch, logprobs=(lp + noise) * batch.loss_mask)


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3", "qwen2_5_omni"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_activation_checkpointing_gives_the_same_gradients_and_keeps_every_name(
    family: str, packed: bool
) -> None:
    model, batch = family_batch(family)
    config = GRPOConfig(temperature=TEMPERATURE, sequence_packing=packed, kl_coef=0.05, entropy_coef=0.01)
    plain = GRPOTrainer(copy.deepcopy(model), config).compute_gradients(batch)
    checkpointed = copy.deepcopy(model)
    names = [n for n, _ in checkpointed.named_parameters()]
    keys = list(checkpointed.state_dict())
    blocks = apply_activation_checkpointing(checkpointed)
    assert blocks == len(checkpointed_blocks(checkpointed)) >= 4  # decoder layers and encoder layers
    assert apply_activation_checkpointing(checkpointed) == blocks  # idempotent
    assert [n for n, _ in checkpointed.named_parameters()] == names and list(
        checkpointed.state_dict()
    ) == keys
    again = GRPOTrainer(checkpointed, config).compute_gradients(batch)
    assert again.loss_sum == pytest.approx(plain.loss_sum, abs=1e-7)
    assert any(bool(g.abs().sum() > 0) for g in plain.grads)
    for a, b in zip(plain.grads, again.grads, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    # a checkpointed copy (the KL reference) is a plain deep copy: loads the same weights by name
    copy.deepcopy(checkpointed).load_state_dict(model.state_dict(), strict=True)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_freezing_finds_each_familys_encoders(family: str) -> None:
    model = tiny_family_policy(family, 0)
    total = trainable_parameters(model)
    encoder_params = {id(p) for name in ENCODERS[family] for p in model.get_submodule(name).parameters()}
    frozen = freeze_encoders(model)
    assert frozen == len(encoder_params) > 0
    assert {id(p) for p in model.parameters() if not p.requires_grad} == encoder_params
    assert 0 < trainable_parameters(model) < total
    assert freeze_encoders(model) == 0  # idempotent


def test_a_model_without_an_encoder_is_refused_by_class_name() -> None:
    with pytest.raises(ValueError, match="Sequential has no vision or audio encoder"):
        freeze_encoders(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="Linear has no block to checkpoint"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2))


def test_a_frozen_tower_gets_no_gradient_and_does_not_move() -> None:
    model, batch = family_batch("qwen2_vl")
    memory = prepare_policy(model, GRPOConfig(freeze_vision_tower=True, activation_checkpointing=True))
    assert memory.frozen_tensors > 0 and memory.checkpointed_blocks == 4
    assert memory.trainable_params < memory.total_params and "encoders frozen" in memory.describe()
    tower = {n: p.detach().clone() for n, p in model.model.visual.named_parameters()}
    text = {n: p.detach().clone() for n, p in model.model.language_model.named_parameters()}
    trainer = GRPOTrainer(model, GRPOConfig(temperature=TEMPERATURE, lr=1e-3))
    assert len(trainer.params) == len(text) + 1  # the language model and the head, no tower
    result = trainer.compute_gradients(batch)
    trainer.apply_gradients(result.grads)
    assert all(p.grad is None for p in model.model.visual.parameters())
    assert all(torch.equal(p, tower[n]) for n, p in model.model.visual.named_parameters())
    assert any(not torch.equal(p, text[n]) for n, p in model.model.language_model.named_parameters())


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_lean_logits_equal_the_full_ones_at_loss_positions(
    family: str, packed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, batch = family_batch(family)
    loss = batch.loss_mask > 0
    for top_p, entropy in ((1.0, False), (0.9, True)):
        kw: dict[str, Any] = dict(
            temperature=TEMPERATURE, suppress_token_ids=None, top_p=top_p, packed=packed, entropy=entropy
        )
        full, full_out, full_ent = forward.scored_logprobs(model, batch, loss_only=False, **kw)
        lean, lean_out, lean_ent = forward.scored_logprobs(model, batch, **kw)
        assert torch.equal(lean[loss], full[loss]) and lean_out == full_out  # bit for bit
        assert bool((lean[~loss] == 0).all()) and bool((full[~loss] != 0).any())
        if entropy:
            assert full_ent is not None and lean_ent is not None and torch.equal(lean_ent, full_ent)
        # past the chunk size each chunk of the head is recomputed in the backward: the same values
        monkeypatch.setattr(forward, "LOGITS_CHUNK_POSITIONS", 5)
        chunked, chunked_out, _ = forward.scored_logprobs(model, batch, **kw)
        monkeypatch.undo()
        assert torch.equal(chunked, lean) and chunked_out == lean_out


def test_chunked_lean_logits_give_the_same_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch = family_batch("qwen2_vl")
    config = GRPOConfig(temperature=TEMPERATURE, entropy_coef=0.01)
    whole = GRPOTrainer(copy.deepcopy(model), config).compute_gradients(batch)
    monkeypatch.setattr(forward, "LOGITS_CHUNK_POSITIONS", 5)
    chunked = GRPOTrainer(copy.deepcopy(model), config).compute_gradients(batch)
    for a, b in zip(whole.grads, chunked.grads, strict=True):  # the head's sum over chunks: float order
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_regression_adamw_at_lr_1e_6_on_bf16_weights_is_lost_and_on_fp32_masters_it_is_not() -> None:
    model, batch = family_batch("qwen2_vl")

    def moved(policy: Any) -> float:
        """Fraction of the weights with a gradient that one GRPO update at lr 1e-6 changed."""
        trainer = GRPOTrainer(policy, GRPOConfig(temperature=TEMPERATURE, lr=1e-6, ratio_tolerance=None))
        before = [p.detach().clone() for p in trainer.params]
        grads = trainer.compute_gradients(batch).grads
        trainer.apply_gradients([g.clone() for g in grads])
        pairs = zip(trainer.params, before, grads, strict=True)
        changed = sum(int(((p != b) & (g != 0)).sum()) for p, b, g in pairs)
        return changed / sum(int((g != 0).sum()) for g in grads)

    bf16 = copy.deepcopy(model).to(torch.bfloat16)  # the cast the run made before: no master copy
    assert moved(bf16) < 0.1  # nearly every update rounds to nothing on a bf16 weight
    masters = copy.deepcopy(model)
    memory = prepare_policy(masters, GRPOConfig(dtype="bfloat16"))
    assert memory.autocast == torch.bfloat16 == autocast_dtype(masters)
    assert next(masters.parameters()).dtype == torch.float32
    assert moved(masters) > 0.9


def test_bf16_autocast_scores_near_the_bf16_generators_weights() -> None:
    """What the drift guard compares on-policy: the fp32 masters under bf16 autocast against the bf16
    copy the generator gets (``ratio_tolerance`` 1e-2 on the mean ratio)."""
    model, batch = family_batch("qwen2_vl")
    prepare_policy(model, GRPOConfig(dtype="bfloat16"))
    generator = copy.deepcopy(model).to(torch.bfloat16)
    enable_autocast(generator, None)  # the generator's own model: plain bf16 weights
    with torch.no_grad():
        kw: dict[str, Any] = dict(temperature=TEMPERATURE, suppress_token_ids=None, top_p=1.0)
        trainer_lp, _, _ = forward.scored_logprobs(model, batch, **kw)
        generator_lp, _, _ = forward.scored_logprobs(generator, batch, **kw)
    loss = batch.loss_mask > 0
    ratio = torch.exp(trainer_lp[loss] - generator_lp[loss])
    assert abs(float(ratio.mean()) - 1.0) < 1e-2


def test_a_run_with_the_memory_settings_says_so_and_trains(tmp_path: Path) -> None:
    settings = {
        **SMALL,
        "bridge.group_size": 4,
        "shaping.kind": "token_rate",  # reward variance: the steps train
        "trainer.activation_checkpointing": True,
        "trainer.freeze_vision_tower": True,
    }
    _, out = quiet_train(run_config(tmp_path / "run", settings))
    line = next(t for t in out.splitlines() if t.startswith("memory: "))
    assert "encoders frozen" in line and "activation checkpointing on 4 blocks" in line
    records = [json.loads(t) for t in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    assert any(r["skipped"] is None and r["grad_norm"] > 0 for r in records)


def test_a_bf16_run_checkpoints_and_resumes_its_fp32_masters(tmp_path: Path) -> None:
    model, batch = family_batch("qwen2_vl")
    config = GRPOConfig(temperature=TEMPERATURE, dtype="bfloat16", kl_coef=0.05, ratio_tolerance=None)
    prepare_policy(model, config)
    trainer = GRPOTrainer(model, config)
    assert trainer.reference is not None and next(trainer.reference.parameters()).dtype == torch.bfloat16
    trainer.step(batch)
    save_checkpoint(tmp_path, step=1, policy_version=1, trainer=trainer, done_task_indices=[])
    fresh = copy.deepcopy(rollouts("qwen2_vl", "tool_image").tiny.model)
    prepare_policy(fresh, config)
    resumed = GRPOTrainer(fresh, config)
    assert load_checkpoint(tmp_path, trainer=resumed) is not None
    for a, b in zip(trainer.params, resumed.params, strict=True):
        assert b.dtype == torch.float32 and torch.equal(a, b)  # the masters, not their bf16 copy
    state = resumed.optimizer.state[resumed.params[0]]
    assert state["exp_avg"].dtype == torch.float32


def test_regression_a_bf16_run_trains_on_fp32_masters_and_publishes_bf16(tmp_path: Path) -> None:
    """copy_weights refused fp32 masters into the bf16 in-process generator (dtype in its layout check)."""
    settings = {**SMALL, "bridge.group_size": 4, "shaping.kind": "token_rate", "trainer.dtype": "bfloat16"}
    _, out = quiet_train(run_config(tmp_path / "run", settings))
    assert "bfloat16 autocast over fp32 master weights" in out
    records = [json.loads(t) for t in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["skipped"] is None and abs(r["ratio_mean"] - 1.0) < 1e-2 for r in records)
