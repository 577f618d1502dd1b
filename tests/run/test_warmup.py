"""The format warm-up leaves out the run's forced first call: it is never sampled, so it is not taught.

Regression (``configs/smoke_color_tool.yaml``): trained on the ``look`` call as well as on the
answer, the tiny model's answer after the tool image stayed at chance with one torch thread;
trained on the answer alone (the call is forced), the same run learned.
"""

from __future__ import annotations

import torch

from gymbridge.generation.hf import HFGenerator
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.run.warmup import WarmupConfig, warmup_for_env
from gymbridge_envs.color_pick.data import LOOK_CALL
from gymbridge_envs.registry import get_env

TOOL_PARAMS = {"colors": "red,green", "img_size": 56, "reveal": "tool", "blank": False}


def _fresh_policy() -> tuple[torch.nn.Module, HFGenerator]:
    tiny = build_tiny_vlm(0)
    policy = type(tiny.model)(tiny.model.config)
    policy.load_state_dict(tiny.model.state_dict())
    return policy, HFGenerator(policy, tiny.processor, max_model_len=2048)


def test_warmup_leaves_out_the_forced_first_call_and_counts_it() -> None:
    spec = get_env("color_pick")
    config = WarmupConfig(steps=2, rows_per_step=2, lr=1e-3)
    policy, generator = _fresh_policy()
    every = warmup_for_env(spec, TOOL_PARAMS, policy, generator, config)
    assert every is not None and every.examples == 8 and every.skipped == 0  # call + answer per row
    policy, generator = _fresh_policy()
    forced = warmup_for_env(spec, TOOL_PARAMS, policy, generator, config, forced_first_call=LOOK_CALL)
    assert forced is not None and forced.steps == 2
    assert forced.examples == 4 and forced.skipped == 4  # the answers only


def test_warmup_whose_every_target_is_the_forced_call_trains_nothing() -> None:
    spec = get_env("zoom_read")  # its only warm-up target is the whole-canvas zoom its config forces
    params = spec.check_params({})
    rows = list(spec.generate(1, 0, **params))
    (items_target,) = spec.data_module().format_examples(rows[0], None)
    policy, generator = _fresh_policy()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    result = warmup_for_env(
        spec,
        params,
        policy,
        generator,
        WarmupConfig(steps=3, rows_per_step=2),
        forced_first_call=items_target[1],
    )
    assert result is not None and result.steps == 0 and result.examples == 0 and result.skipped == 6
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


def _answer_probabilities(
    policy: torch.nn.Module, generator: HFGenerator, params: dict[str, object]
) -> dict[tuple[str, str], float]:
    """P(first answer token) for each colour word, on one row of each colour."""
    from gymbridge.run.warmup import _example_tensors

    spec = get_env("color_pick")
    rows = list(spec.generate(8, 7, **params))
    out: dict[tuple[str, str], float] = {}
    words = [str(w) for w in rows[0]["colors"]]
    ids = {w: generator.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words}
    for row in rows:
        colour = str(row["color"])
        if any(key[0] == colour for key in out):
            continue
        kwargs, prompt_len, _ = _example_tensors(
            generator, list(row["responses_create_params"]["input"]), None, words[0]
        )
        with torch.no_grad():
            logits = policy(**kwargs).logits[0, prompt_len - 1].float()
        probs = torch.softmax(logits, dim=-1)
        for w in words:
            out[(colour, w)] = float(probs[ids[w]])
    return out


def test_regression_linear_warmup_leaves_the_answers_about_uniform() -> None:
    """The smoke's warm-up (40 steps at lr 1e-2, random targets) with a constant lr ended wherever its
    last batches pushed: blue 0.83 / red 0.17 for every image at step 1, and runs that fell into
    answering blue to every image never left it (docs/benchmarks.md, "Learning robustness").
    ``lr_schedule: linear`` lets the last steps move the policy less and less."""
    spec = get_env("color_pick")
    params = spec.check_params({})
    policy, generator = _fresh_policy()
    config = WarmupConfig(steps=40, lr=1e-2, rows_per_step=4, lr_schedule="linear")
    result = warmup_for_env(spec, params, policy, generator, config)
    assert result is not None and result.steps == 40 and result.last_loss < result.first_loss
    probs = _answer_probabilities(policy, generator, params)
    assert len(probs) == 4, probs  # both images, both words
    assert all(0.3 <= p <= 0.7 for p in probs.values()), probs
