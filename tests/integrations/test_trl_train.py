"""TRL 1.16's real ``GRPOTrainer.train()`` on a NeMo Gym environment whose tool returns images (CPU).

``color_pick`` with ``reveal: tool``: the prompt holds no image; the ``look`` tool answers the
row's colour as an image, so the answer can only come from a tool image. ``gym_environment``
serves ``ColorPickServer`` on loopback, TRL's own tool loop calls ``look`` through the generated
method, and the server's ``/verify`` scores every rollout (logged, weight 0). After the format
warm-up (``warm_up`` trains until the call and either colour word after an image of a third
colour are learned, or raises) two GRPO steps must carry every tool image into the training
forward (as many images as look calls) and move the vision tower. The trained reward alternates
0, 1 within each group, so every group has reward variance by construction and the gradient
cannot vanish on an unlucky draw of sampled answers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the TRL adapter tests need the trl extra (pip install 'gymbridge[trl]')")

from _trl_support import (
    LOOK_CALL,
    ForwardSpy,
    changed,
    encode,
    encode_after_tool,
    one_torch_thread,
    spying_trainer,
    tiny_for_trl,
    vision_params,
    warm_up,
)

from gymbridge.errors import TrainingError
from gymbridge.integrations.trl import gym_environment, trl_rows
from gymbridge_envs.color_pick.data import generate, render
from gymbridge_envs.color_pick.server import ColorPickServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

COLORS = ("red", "green")


def _tool_images(completions: list[list[dict[str, Any]]]) -> int:
    return sum(
        1
        for completion in completions
        for message in completion
        if message.get("role") == "tool" and isinstance(message.get("content"), list)
        for block in message["content"]
        if block.get("type") == "image"
    )


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def _format_examples(tiny: Any, env: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``look`` call, then either colour word after an image of blue, a colour no row asks about."""
    probe = env()
    tools = [getattr(probe, name) for name in sorted(env.tool_names)]
    assert [t.__name__ for t in tools] == ["look"]
    user = [{"role": "user", "content": rows[0]["responses_create_params"]["input"][0]["content"]}]
    first = encode(tiny.processing_class, user, tools, LOOK_CALL)
    shown = [{"type": "text", "text": "The image:"}, {"type": "image", "image": render("blue", 56)}]
    looked = {"role": "tool", "name": "look", "content": shown}
    return [first, *(encode_after_tool(tiny.processing_class, first, looked, word) for word in COLORS)]


def test_regression_warm_up_stops_naming_what_was_not_learned() -> None:
    """At its step cap the warm-up raises, naming example and token, instead of handing GRPO a
    model that never calls the tool (a fixed step count sufficed on AVX2 kernels, not on AVX-512)."""
    tiny = tiny_for_trl()
    rows = list(generate(2, 0, colors=",".join(COLORS), reveal="tool"))
    with gym_environment(ColorPickServer, processing_class=tiny.processing_class) as env:
        examples = _format_examples(tiny, env, rows)
    with pytest.raises(TrainingError, match=r"not learned in 2 steps.*example 0: p\(target\) 0\.0"):
        warm_up(tiny, examples, max_steps=2)


def test_grpo_trainer_trains_on_tool_images_from_a_gym_environment(tmp_path: Path) -> None:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.manual_seed(0)
    tiny = tiny_for_trl()
    rows = list(generate(8, 0, colors=",".join(COLORS), reveal="tool"))
    with gym_environment(ColorPickServer, processing_class=tiny.processing_class) as env:
        warm_up(tiny, _format_examples(tiny, env, rows))  # p(call) >= 0.9, either word after the image

        spy = ForwardSpy()
        tool_images: list[int] = []

        def alternating(completions: list[Any], **_: Any) -> list[float]:
            """0, 1, 0, 1, ...: TRL hands a group's rollouts in a row, so each group holds both."""
            tool_images.append(_tool_images(completions))
            return [float(i % 2) for i in range(len(completions))]

        args = GRPOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
            max_completion_length=96, max_steps=2, learning_rate=5e-3, temperature=0.7,
            max_tool_calling_iterations=2, reward_weights=[0.0, 1.0], beta=0.0, logging_steps=1,
            report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
            save_strategy="no", dataloader_num_workers=0, seed=0,
        )  # fmt: skip
        before = vision_params(tiny.model)
        trainer = spying_trainer(
            spy,
            model=tiny.model,
            reward_funcs=[env.reward_func, alternating],
            args=args,
            train_dataset=Dataset.from_list(trl_rows(rows)),
            processing_class=tiny.processing_class,
            environment_factory=env,
        )
        trainer.train()

    logs = [h for h in trainer.state.log_history if "rewards/gym_verify/mean" in h]
    assert len(logs) == 2, trainer.state.log_history
    assert env.failures == []
    assert all(0.0 <= h["rewards/gym_verify/mean"] <= 1.0 for h in logs), logs  # /verify scored them all
    assert all(h["frac_reward_zero_std"] == 0.0 for h in logs), logs  # every group had a gradient
    assert sum(h["tools/call_frequency"] for h in logs) > 0, logs  # TRL parsed and ran the generated tool
    assert sum(tool_images) > 0
    # every tool image of a generation batch reached its training forward, and nothing else did
    assert sum(spy.images_per_forward) == sum(tool_images), (spy.images_per_forward, tool_images)
    assert changed(before, tiny.model), "the vision tower got no gradient from the tool images"
