"""Checkpoints for the export tests: a run directory as the trainer writes it, of a "trained" tiny
model (tests/trainer/test_export.py, tests/vllm/test_vllm_export.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from gymbridge.safe_io import save_state
from gymbridge.trainer.export import ModelParts

FORMAT = "gymbridge-run-checkpoint/1"


def perturbed(model: Any, seed: int) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every parameter moved (a "trained" policy; tied ones stay tied)."""
    draw = torch.Generator().manual_seed(seed)
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for param in trained.parameters():  # a tied parameter is one object: moved once
            param.add_(0.01 * torch.randn(param.shape, generator=draw))
    return {name: tensor.clone() for name, tensor in trained.state_dict().items()}


def write_run(root: Path, weights: dict[str, torch.Tensor], *, steps: tuple[int, ...] = (2,)) -> Path:
    """A run directory whose last checkpoint holds ``weights`` (an earlier step ``s``: + ``s - last``)."""
    ckpts = root / "checkpoints"
    ckpts.mkdir(parents=True)
    for step in steps:
        tensors = {
            f"model.{k}": (v + (step - steps[-1]) if v.is_floating_point() else v) for k, v in weights.items()
        }
        tensors["optim.0.exp_avg"] = torch.zeros(3)
        tensors["rng.torch"] = torch.get_rng_state()
        save_state(ckpts / f"step-{step:06d}.ckpt", tensors, {"format": FORMAT, "step": step})
    latest = {"format": FORMAT, "step": steps[-1], "state": f"step-{steps[-1]:06d}.ckpt"}
    (ckpts / "latest.json").write_text(json.dumps(latest))
    return root


def parts_of(tiny: Any) -> ModelParts:
    return ModelParts(type(tiny.model), tiny.model.config, tiny.model.generation_config, tiny.processor)
