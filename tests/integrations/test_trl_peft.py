"""TRL 1.16's ``GRPOTrainer`` with ``peft_config`` (LoRA) on a NeMo Gym environment (CPU, tiny Qwen2-VL).

The model TRL gets is the plain tiny Qwen2-VL; ``peft_config`` is a ``peft.LoraConfig`` whose
``target_modules`` is gymbridge's ``target_regex(DEFAULT_TARGETS)``: the language model's attention
and MLP projections, nothing under the vision tower. ``gym_environment(ColorPickServer, ...)`` is
the ``environment_factory`` (``reveal: prompt``: every prompt holds an image, so every forward runs
the frozen vision tower) and ``/verify`` scores each rollout (logged, weight 0); the trained reward
alternates 0, 1 within each group, so each step has a gradient by construction. ``beta > 0``: TRL
builds no reference model and takes the reference log-probs from the same model with its adapters
disabled. Two steps, trained once for the module (a few seconds); each test reads that run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the TRL adapter tests need the trl extra (pip install 'gymbridge[trl]')")
pytest.importorskip("peft", reason="TRL's peft_config needs peft (pip install 'gymbridge[train]')")

import torch

from gymbridge.integrations.trl import gym_environment, trl_rows
from gymbridge.testing.trl_format import one_torch_thread, tiny_for_trl
from gymbridge.trainer.lora import DEFAULT_TARGETS, adapter_file_name, target_regex
from gymbridge_envs.color_pick.data import generate
from gymbridge_envs.color_pick.server import ColorPickServer

pytestmark = pytest.mark.integration

STEPS = 2
LANGUAGE_LAYERS = 2  # the tiny Qwen2-VL's decoder layers


@dataclass(frozen=True)
class Forward:
    """One ``_get_per_token_logps_and_entropies`` call: the adapters' state, autograd, images carried."""

    adapters_enabled: bool
    grad: bool
    images: int


@dataclass
class Run:
    trainer: Any
    before: dict[str, torch.Tensor]
    """Every parameter of the model handed to TRL, before training."""
    adapter_dir: Path
    forwards: list[Forward] = field(default_factory=list)


def _base_name(name: str) -> str:
    """A wrapped weight under its plain name (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
    return name.replace(".base_layer.", ".")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    from datasets import Dataset
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    forwards: list[Forward] = []

    class SpyingGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **forward: Any) -> Any:
            layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
            grid = forward.get("image_grid_thw")
            forwards.append(
                Forward(
                    adapters_enabled=bool(layers) and not any(layer.disable_adapters for layer in layers),
                    grad=torch.is_grad_enabled(),
                    images=0 if grid is None else int(grid.shape[0]),
                )
            )
            return super()._get_per_token_logps_and_entropies(model, *args, **forward)

    def alternating(completions: list[Any], **_: Any) -> list[float]:
        """0, 1, 0, 1, ...: TRL hands a group's rollouts in a row, so each group holds both."""
        return [float(i % 2) for i in range(len(completions))]

    out = tmp_path_factory.mktemp("trl-peft")
    with one_torch_thread():
        torch.manual_seed(0)
        tiny = tiny_for_trl()
        before = {n: p.detach().clone() for n, p in tiny.model.named_parameters()}
        rows = list(generate(4, 0, colors="red,green", reveal="prompt"))
        with gym_environment(ColorPickServer, processing_class=tiny.processing_class) as env:
            trainer = SpyingGRPOTrainer(
                model=tiny.model,
                processing_class=tiny.processing_class,
                reward_funcs=[env.reward_func, alternating],
                environment_factory=env,
                train_dataset=Dataset.from_list(trl_rows(rows)),
                peft_config=LoraConfig(
                    r=8, lora_alpha=16, target_modules=target_regex(DEFAULT_TARGETS), task_type="CAUSAL_LM"
                ),
                args=GRPOConfig(
                    output_dir=str(out / "trl"), per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=8, max_steps=STEPS, learning_rate=5e-2, beta=0.1,
                    reward_weights=[0.0, 1.0], logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                    gradient_checkpointing=False, save_strategy="no", dataloader_num_workers=0, seed=0,
                ),
            )  # fmt: skip
            trainer.train()
        assert env.failures == []
        trainer.save_model(str(out / "adapter"))
    return Run(trainer=trainer, before=before, adapter_dir=out / "adapter", forwards=forwards)


def _adapter_params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.get_base_model().named_parameters() if ".lora_" in n}


def test_the_trainer_wraps_the_model_with_adapters_on_the_language_model_only(run: Run) -> None:
    from peft import PeftModel

    model = run.trainer.model
    assert isinstance(model, PeftModel)
    adapters = _adapter_params(model)
    adapted = {n.split(".lora_")[0] for n in adapters}
    assert len(adapted) == LANGUAGE_LAYERS * len(DEFAULT_TARGETS), sorted(adapted)
    assert all(n.startswith("model.language_model.layers.") for n in adapted), sorted(adapted)
    assert {n.rsplit(".", 1)[-1] for n in adapted} == set(DEFAULT_TARGETS)
    trainable = {n for n, p in model.get_base_model().named_parameters() if p.requires_grad}
    assert trainable == set(adapters)  # the vision tower, embeddings and lm_head are frozen


def test_training_moves_the_adapters_and_leaves_every_base_weight_bit_identical(run: Run) -> None:
    logs = [h for h in run.trainer.state.log_history if "rewards/gym_verify/mean" in h]
    assert len(logs) == STEPS, run.trainer.state.log_history
    assert all(h["frac_reward_zero_std"] == 0.0 for h in logs), logs  # every step had a gradient
    # the frozen vision tower ran on the prompt images in every forward
    assert run.forwards and all(f.images > 0 for f in run.forwards), run.forwards

    params = run.trainer.model.get_base_model().named_parameters()
    base = {_base_name(n): p.detach() for n, p in params if ".lora_" not in n}
    assert base.keys() == run.before.keys()
    moved = [n for n, p in base.items() if not torch.equal(p, run.before[n])]
    assert moved == [], moved
    # lora_B starts at zero (a fresh adapter changes no output); each one trained
    still_zero = [n for n, p in _adapter_params(run.trainer.model).items() if ".lora_B." in n and not p.any()]
    assert still_zero == [], still_zero


def test_the_kl_reference_is_the_base_model_with_adapters_disabled(run: Run) -> None:
    """No second model: each generation batch has one gradient-free forward with every adapter
    disabled (the reference); at step 1 the fresh adapters change nothing, so the KL is zero, and
    once they have trained it is not."""
    assert run.trainer.ref_model is None
    reference = [f for f in run.forwards if not f.adapters_enabled]
    policy = [f for f in run.forwards if f.adapters_enabled]
    assert len(reference) == STEPS and not any(f.grad for f in reference), run.forwards
    assert policy and all(f.grad for f in policy), run.forwards
    kl = [h["kl"] for h in run.trainer.state.log_history if "kl" in h]
    assert len(kl) == STEPS
    assert kl[0] == pytest.approx(0.0, abs=1e-7), kl
    assert kl[1] > 1e-4, kl


def test_the_saved_adapter_reloads_onto_the_base_model_with_gymbridges_file_names(run: Run) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    from gymbridge.trainer.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    assert {p.name for p in run.adapter_dir.iterdir()} >= {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    saved = load_file(str(run.adapter_dir / ADAPTER_WEIGHTS))
    assert set(saved) == {adapter_file_name(n) for n in _adapter_params(run.trainer.model)}

    base = tiny_for_trl().model
    base.load_state_dict(run.before)
    reloaded = PeftModel.from_pretrained(base, str(run.adapter_dir)).eval()
    trained = run.trainer.model.eval()
    input_ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        logits = reloaded(input_ids=input_ids).logits
        torch.testing.assert_close(logits, trained(input_ids=input_ids).logits)
        with reloaded.disable_adapter():  # the trained adapter is not a no-op
            assert not torch.allclose(logits, reloaded(input_ids=input_ids).logits)
