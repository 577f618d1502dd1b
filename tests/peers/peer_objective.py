"""Run inside ``.venv-verl``: verl's and TRL's own objective functions on the cases given on stdin.

Reads ``{"cases": [...]}`` (JSON) on stdin and prints ``{"results": [...]}`` (JSON), one result
per case, computed by the peers' installed code (verl 0.9.1, TRL 1.16.0), never by a copy of it:

* ``verl_policy_loss``: ``verl.trainer.ppo.core_algos.compute_policy_loss_vanilla`` (``clip_ratio_c``
  in its config): the loss and its gradient with respect to the new logprobs;
* ``verl_kl``: ``verl.trainer.ppo.core_algos.kl_penalty``: values and gradient of their sum;
* ``verl_grpo_advantage``: ``compute_grpo_outcome_advantage`` (outcome rewards on the last token);
* ``verl_lr``: the learning rate of each optimizer update under
  ``verl.utils.torch_functional.get_cosine_schedule_with_warmup`` (a ``LambdaLR``);
* ``trl_loss``: ``trl.GRPOTrainer._compute_loss`` on a stand-in trainer object that holds the
  attributes the method reads and returns the given logprobs as the model's
  (``_get_per_token_logps_and_entropies``), in eval mode (no gradient accumulation scaling):
  the loss and its gradient with respect to those logprobs.

Only this file imports verl / TRL; gymbridge is never imported here (tests/peers/ compares).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch


def _t(x: Any, grad: bool = False) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def verl_policy_loss(case: dict[str, Any]) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    new = _t(case["new"], grad=True)
    old = _t(case["old"])
    mask = _t(case["mask"])
    adv = _t(case["advantages"])[:, None].expand_as(mask)
    config = OmegaConf.create(
        {
            "clip_ratio": case["clip_low"],
            "clip_ratio_low": case["clip_low"],
            "clip_ratio_high": case["clip_high"],
            "clip_ratio_c": case["clip_ratio_c"],
            "global_batch_info": {},
        }
    )
    loss, metrics = compute_policy_loss_vanilla(old, new, adv, mask, case["loss_agg_mode"], config)
    (grad,) = torch.autograd.grad(loss, new)
    return {
        "loss": float(loss.detach()),
        "grad": grad.tolist(),
        "clipfrac_lower": metrics["actor/pg_clipfrac_lower"],
    }


def verl_kl(case: dict[str, Any]) -> dict[str, Any]:
    from verl.trainer.ppo.core_algos import kl_penalty

    new = _t(case["new"], grad=True)
    ref = _t(case["ref"])
    kl = kl_penalty(new, ref, case["kl_penalty"])
    (grad,) = torch.autograd.grad(kl.sum(), new)
    return {"kl": kl.tolist(), "grad": grad.tolist()}


def verl_grpo_advantage(case: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rewards = _t(case["rewards"])
    length = 3
    token_rewards = torch.zeros(len(rewards), length, dtype=torch.float64)
    token_rewards[:, -1] = rewards
    mask = torch.ones(len(rewards), length, dtype=torch.float64)
    adv, _ = compute_grpo_outcome_advantage(
        token_rewards, mask, np.array(case["index"]), norm_adv_by_std_in_grpo=case["norm_by_std"]
    )
    return {"advantages": adv[:, 0].tolist()}


def verl_lr(case: dict[str, Any]) -> dict[str, Any]:
    from verl.utils.torch_functional import get_cosine_schedule_with_warmup

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=case["lr"])
    sched = get_cosine_schedule_with_warmup(
        opt,
        num_warmup_steps=case["warmup"],
        num_training_steps=case["total"],
        min_lr_ratio=case["min_lr_ratio"],
        zero_indexed_step=case["zero_indexed_step"],
    )
    used = []
    for _ in range(case["updates"]):
        used.append(opt.param_groups[0]["lr"])  # the learning rate this update runs at
        opt.step()
        sched.step()
    return {"lr": used}


def _trl_stand_in(case: dict[str, Any], new: torch.Tensor) -> SimpleNamespace:
    """The attributes ``GRPOTrainer._compute_loss`` reads, for one process in eval mode."""

    def logps_and_entropies(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, None]:
        return new, torch.zeros_like(new), None

    accelerator = SimpleNamespace(
        num_processes=1,
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction="sum": x,
    )
    args = SimpleNamespace(
        use_bias_correction_kl=case["use_bias_correction_kl"],
        delta=case["delta"],
    )
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=logps_and_entropies,
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=case["beta"],
        args=args,
        loss_type=case["loss_type"],
        epsilon_low=case["epsilon_low"],
        epsilon_high=case["epsilon_high"],
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=False),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        accelerator=accelerator,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        max_completion_length=len(case["new"][0]),
    )


def trl_loss(case: dict[str, Any]) -> dict[str, Any]:
    from trl import GRPOTrainer

    new = _t(case["new"], grad=True)
    mask = torch.tensor(case["mask"], dtype=torch.long)
    rows, length = mask.shape
    inputs: dict[str, Any] = {
        "prompt_ids": torch.ones(rows, 2, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
        "completion_ids": torch.ones(rows, length, dtype=torch.long),
        "completion_mask": mask,
        "advantages": _t(case["advantages"]),
        "old_per_token_logps": _t(case["old"]),
        "num_items_in_batch": mask.sum(),
    }
    if case["beta"]:
        inputs["ref_per_token_logps"] = _t(case["ref"])
    stand_in = _trl_stand_in(case, new)
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    (grad,) = torch.autograd.grad(loss, new)
    kl = stand_in._metrics["eval"].get("kl")
    return {"loss": float(loss.detach()), "grad": grad.tolist(), "kl_metric": kl[0] if kl else None}


KINDS = {
    "verl_policy_loss": verl_policy_loss,
    "verl_kl": verl_kl,
    "verl_grpo_advantage": verl_grpo_advantage,
    "verl_lr": verl_lr,
    "trl_loss": trl_loss,
}


def main() -> None:
    import trl
    import verl

    cases = json.load(sys.stdin)["cases"]
    results = [KINDS[case["kind"]](case) for case in cases]
    json.dump(
        {"versions": {"trl": trl.__version__, "verl": verl.__version__}, "results": results}, sys.stdout
    )


if __name__ == "__main__":
    main()
