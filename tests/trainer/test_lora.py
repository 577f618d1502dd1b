"""LoRA (``trainer.lora``, :mod:`gymbridge.generation.lora`): adapters on the language model only,
zero-initialised adapters change nothing, the KL reference is the base with the adapters off (no
copy), a step moves only the adapters, publication sends only them (in process, shared memory,
broadcast) and the generator then scores as the trainer does, and checkpoints hold the adapters
and resume exactly."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from trainer_helpers import make_batch, with_current_logprobs

from gymbridge.errors import CheckpointError, WeightSyncError
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.lora import (
    DEFAULT_TARGETS,
    LoRAConfig,
    adapters_disabled,
    apply_lora,
    is_adapter_name,
    lora_settings,
    published_names,
)
from gymbridge.generation.weights import WeightReceiver, named_weights, published_weights
from gymbridge.models.tiny_families import TINY_FAMILIES, tiny_family_policy
from gymbridge.models.tiny_vlm import TinyVLM, build_tiny_vlm
from gymbridge.tensors import TrainBatch
from gymbridge.testing.model_server import TESTING_WEIGHTS_SECRET, served_in_thread
from gymbridge.trainer import GRPOConfig, GRPOTrainer, tiny_policy, token_logprobs
from gymbridge.trainer.checkpoint import load_checkpoint, save_checkpoint
from gymbridge.trainer.memory import ENCODER_NAMES
from gymbridge.trainer.weight_sync import DistributedPublisher, InProcessPublisher, payload_bytes

RANK8 = LoRAConfig(rank=8)


@pytest.fixture(scope="module")
def batch(tiny: TinyVLM) -> TrainBatch:
    return make_batch(tiny)


def lora_policy(config: LoRAConfig = RANK8, seed: int = 0) -> torch.nn.Module:
    model = tiny_policy(seed)
    apply_lora(model, config)
    return model


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    mine, theirs = a.state_dict(), b.state_dict()
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def kicked(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """``model`` with every adapter ``B`` moved off zero (an adapter that changes outputs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_adapters_sit_on_the_language_model_only_and_start_as_the_base(family: str) -> None:
    base = tiny_family_policy(family, 0).eval()
    model = copy.deepcopy(base)
    info = apply_lora(model, RANK8)
    adapted = {n.rsplit(".lora_", 1)[0] for n, _ in model.named_parameters() if is_adapter_name(n)}
    assert len(adapted) == info.adapted_modules > 0
    assert all(n.rsplit(".", 1)[-1] in DEFAULT_TARGETS for n in adapted)
    assert not [n for n in adapted if any(f".{e}." in f".{n}." for e in ENCODER_NAMES)]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == published_names(model) and all(is_adapter_name(n) for n in trainable)
    ids = torch.tensor([[3, 17, 40, 9, 22, 5]])
    with torch.no_grad():  # a fresh adapter (B = 0) changes nothing, bit for bit
        assert torch.equal(model(input_ids=ids).logits, base(input_ids=ids).logits)
        kicked(model)
        moved = model(input_ids=ids).logits
        with adapters_disabled(model):
            off = model(input_ids=ids).logits
    assert not torch.equal(moved, off)
    assert torch.equal(off, base(input_ids=ids).logits)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable  # restored


def test_vision_full_trains_and_publishes_the_tower_and_bad_settings_are_refused() -> None:
    model = lora_policy(LoRAConfig(rank=4, vision="full"))
    names = published_names(model)
    assert names is not None and any(n.startswith("model.visual.") for n in names)
    assert all(is_adapter_name(n) or n.startswith("model.visual.") for n in names)
    with pytest.raises(ValidationError, match="freeze_vision_tower"):
        GRPOConfig(lora=LoRAConfig(rank=4, vision="full"), freeze_vision_tower=True)
    with pytest.raises(ValidationError, match="module names"):
        LoRAConfig(rank=4, target_modules=("model.*",))
    with pytest.raises(ValueError, match=r"matches no linear layer.*q_proj"):
        apply_lora(tiny_policy(0), LoRAConfig(rank=4, target_modules=("no_such_proj",)))
    with pytest.raises(ValueError, match="already holds"):
        apply_lora(model, RANK8)


def test_regression_the_adapters_start_from_the_init_seed_not_the_global_rng() -> None:
    """Two runs of one config started from different adapters (peft draws ``A`` from the global RNG):
    a resumed run could not match one that never stopped. ``apply_lora`` seeds them and leaves the
    global RNG where it was."""
    torch.manual_seed(1)
    a = lora_policy()
    after_a = torch.rand(1)
    torch.manual_seed(2)
    b = lora_policy()
    assert same_weights(a, b)
    torch.manual_seed(1)
    assert torch.equal(torch.rand(1), after_a)
    c = tiny_policy(0)
    apply_lora(c, RANK8, init_seed=5)
    assert not same_weights(a, c)


def test_full_modules_train_in_full_beside_the_adapters_and_publish_and_checkpoint(
    tmp_path: Any, tiny: TinyVLM, batch: TrainBatch
) -> None:
    config = LoRAConfig(rank=4, full_modules=("lm_head",))
    model = lora_policy(config)
    names = published_names(model)
    assert names is not None and "lm_head.weight" in names
    assert all(is_adapter_name(n) or n == "lm_head.weight" for n in names)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2))
    head = model.lm_head.weight.detach().clone()
    trainer.step(with_current_logprobs(model, batch))
    assert not torch.equal(model.lm_head.weight, head)
    generator_model = lora_policy(config)
    InProcessPublisher(HFGenerator(generator_model, tiny.processor, max_model_len=256)).publish(model, 1)
    assert same_weights(generator_model, model)
    save_checkpoint(tmp_path, step=1, policy_version=1, trainer=trainer, done_task_indices=[0])
    resumed = GRPOTrainer(lora_policy(config), GRPOConfig(lr=1e-2))
    load_checkpoint(tmp_path, trainer=resumed)
    assert same_weights(resumed.model, model)
    with pytest.raises(ValidationError, match="name each in one"):
        LoRAConfig(rank=4, target_modules=("q_proj", "lm_head"), full_modules=("lm_head",))
    untouched = tiny_policy(0)
    with pytest.raises(ValueError, match="has no module named"):
        apply_lora(untouched, LoRAConfig(rank=4, full_modules=("no_such_head",)))
    assert not any(is_adapter_name(n) for n in untouched.state_dict())  # refused before peft injects


def test_a_step_moves_only_the_adapters_and_the_kl_reference_is_the_base(
    tiny: TinyVLM, batch: TrainBatch
) -> None:
    model = lora_policy()
    base = {n: t.clone() for n, t in model.state_dict().items() if not is_adapter_name(n)}
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2, kl_coef=0.1))
    assert trainer.reference is None and trainer.kl_reference == "base_adapters_off"
    trainer.freeze_reference()  # what a run does after its warm-up: still no copy
    assert trainer.reference is None
    fresh = with_current_logprobs(model, batch)
    first = trainer.step(fresh)
    assert first.kl == 0.0  # adapters at zero: the policy is its reference
    second = trainer.step(with_current_logprobs(model, batch))
    assert second.kl > 0.0
    after = model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in base.items())
    assert any(not torch.equal(t, torch.zeros_like(t)) for n, t in after.items() if "lora_B" in n)
    with torch.no_grad(), adapters_disabled(model):
        ref = token_logprobs(model, batch)
    with torch.no_grad():
        plain = token_logprobs(tiny_policy(0), batch)
    assert torch.equal(ref, plain)


def test_packing_and_encoder_dedup_give_a_lora_policy_the_same_gradients(batch: TrainBatch) -> None:
    model = kicked(lora_policy())
    fresh = with_current_logprobs(model, batch)

    def grads(**settings: Any) -> list[torch.Tensor]:
        trainer = GRPOTrainer(model, GRPOConfig(micro_batch_max_tokens=200, **settings))
        return trainer.compute_gradients(fresh).grads

    plain = grads(sequence_packing=False, encoder_dedup=False)
    assert len(plain) == sum(is_adapter_name(n) for n, _ in model.named_parameters())
    for other in (grads(sequence_packing=True), grads(encoder_dedup=True)):
        for a, b in zip(plain, other, strict=True):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_in_process_publication_sends_only_the_adapters_and_the_generator_scores_as_the_trainer(
    tiny: TinyVLM, batch: TrainBatch
) -> None:
    trainer_model = kicked(lora_policy())
    generator_model = lora_policy()  # the same base and adapter layout, adapters at zero
    gen = HFGenerator(generator_model, tiny.processor, max_model_len=256)
    publisher = InProcessPublisher(gen)
    publisher.publish(trainer_model, 1)
    adapter_bytes = sum(
        t.numel() * t.element_size() for n, t in named_weights(trainer_model) if is_adapter_name(n)
    )
    full_bytes = sum(t.numel() * t.element_size() for _, t in named_weights(trainer_model))
    assert publisher.last_bytes == payload_bytes(trainer_model) == adapter_bytes < full_bytes / 10
    with torch.no_grad():
        assert torch.equal(token_logprobs(generator_model, batch), token_logprobs(trainer_model, batch))
    plain = HFGenerator(tiny_policy(0), tiny.processor, max_model_len=256)  # no adapters to receive them
    with pytest.raises(WeightSyncError, match="not a weight of the receiving model"):
        InProcessPublisher(plain).publish(trainer_model, 1)


@pytest.fixture
def served() -> Iterator[tuple[str, WeightReceiver, HFGenerator]]:
    """A model server (plain tiny Qwen2-VL, no adapters) with weight updates on, in its own thread."""
    gen = HFGenerator(tiny_policy(0), build_tiny_vlm(0).processor, max_model_len=256)
    receiver = WeightReceiver(gen)
    with served_in_thread(gen, receiver) as url:
        yield url, receiver, gen


@pytest.mark.parametrize("transport", ["shared_memory", "broadcast"])
def test_a_model_server_takes_the_adapters_and_then_only_adapters_travel(
    served: tuple[str, WeightReceiver, HFGenerator], transport: Any, batch: TrainBatch
) -> None:
    url, _, gen = served
    trainer_model = lora_policy()
    publisher = DistributedPublisher(url, timeout_s=30, transport=transport, secret=TESTING_WEIGHTS_SECRET)
    try:
        for version in (1, 2):
            kicked(trainer_model, version)
            publisher.publish(trainer_model, version)
            assert publisher.transport == transport and gen.policy_version == version
            assert lora_settings(gen.model) == lora_settings(trainer_model)  # injected by init_group
            assert publisher.last_bytes == payload_bytes(trainer_model)
            assert len(published_weights(trainer_model)) == sum(
                is_adapter_name(n) for n, _ in named_weights(trainer_model)
            )
            with torch.no_grad():
                assert torch.equal(token_logprobs(gen.model, batch), token_logprobs(trainer_model, batch))
    finally:
        publisher.close()
    full = DistributedPublisher(
        url, timeout_s=30, transport=transport, secret=TESTING_WEIGHTS_SECRET
    )  # a full-weight trainer now
    try:
        with pytest.raises(WeightSyncError, match="holds LoRA adapters"):
            full.publish(tiny_policy(0), 3)
    finally:
        full.close()


def test_a_checkpoint_holds_the_adapters_and_resumes_exactly(tmp_path: Any, batch: TrainBatch) -> None:
    model = lora_policy()
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2))
    trainer.step(with_current_logprobs(model, batch))
    ckpt = save_checkpoint(tmp_path, step=1, policy_version=1, trainer=trainer, done_task_indices=[0, 1])
    full_ckpt = save_checkpoint(
        tmp_path / "full",
        step=1,
        policy_version=1,
        trainer=GRPOTrainer(tiny_policy(0)),
        done_task_indices=[0],
    )
    assert ckpt.stat().st_size < full_ckpt.stat().st_size / 4  # adapters and their AdamW state only

    resumed = GRPOTrainer(lora_policy(), GRPOConfig(lr=1e-2))
    state = load_checkpoint(tmp_path, trainer=resumed)
    assert state is not None and state.step == 1 and resumed.steps == 1
    assert same_weights(resumed.model, model)
    nxt = with_current_logprobs(model, batch)
    trainer.step(nxt)
    resumed.step(nxt)  # the optimizer state came back too: the second step is the same step
    assert same_weights(resumed.model, model)

    with pytest.raises(CheckpointError, match="this run trains full weights"):
        load_checkpoint(tmp_path, trainer=GRPOTrainer(tiny_policy(0)))
    with pytest.raises(CheckpointError, match="this run's are"):
        load_checkpoint(tmp_path, trainer=GRPOTrainer(lora_policy(LoRAConfig(rank=4))))
    with pytest.raises(CheckpointError, match="holds full weights"):
        load_checkpoint(tmp_path / "full", trainer=GRPOTrainer(lora_policy()))


def test_vllm_takes_full_tensors_only_of_the_full_modules_or_a_full_tower() -> None:
    from gymbridge.generation.vllm import lora_layout_problems

    adapter = "model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight"
    frozen = {"r": 8, "vision": "frozen", "full_modules": []}
    assert lora_layout_problems([adapter], frozen) == []
    assert lora_layout_problems([adapter, "lm_head.weight"], frozen)  # a full head, not declared
    assert lora_layout_problems([adapter, "lm_head.weight"], {**frozen, "full_modules": ["lm_head"]}) == []
    assert (
        lora_layout_problems([adapter, "model.visual.blocks.0.attn.qkv.weight"], {**frozen, "vision": "full"})
        == []
    )
