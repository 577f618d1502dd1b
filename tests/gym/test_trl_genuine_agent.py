"""TRL 1.16's ``GRPOTrainer.train()``, ``gym_rollout_func``, genuine nemo-gym 0.7.0 ``simple_agent``.

The deployment a TRL user would have: our ``color_pick`` environment, a genuine ``simple_agent`` from
``.venv-gym`` in front of it, and as its ``policy_model`` gymbridge's model server over the very
model object TRL trains (so every rollout samples from the current weights). TRL hands the
rollout_func each dataset prompt ``num_generations`` times; each copy is one ``POST /run``, and
the genuine agent's token ids train TRL's model, the row's image in its forward. A row that gives
the agent tools makes its first prompt differ from TRL's render: refused before TRL misaligns the
pixels.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _genuine import KIND_MODELS, KIND_RESOURCES, GenuineStack, free_port
from _gym_support import MODEL_NAME, ThreadedLoop, add_genuine_simple_agent

pytest.importorskip("trl", reason="the TRL adapter tests need the trl extra (pip install 'gymbridge[trl]')")

import gymbridge.server as server_sdk
from gymbridge.errors import UntrainableRolloutError

pytestmark = [pytest.mark.gym, pytest.mark.timeout(1800)]

COLORS = ("red", "blue")
# the TRL helpers live beside the other TRL tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))


@pytest.fixture(scope="module")
def tiny() -> Iterator[Any]:
    from _trl_support import one_torch_thread, tiny_for_trl

    with one_torch_thread():  # the model server's generations included
        yield tiny_for_trl()


@pytest.fixture(scope="module")
def deployment(fixture_loop: ThreadedLoop, gym_log_root: Path, tiny: Any) -> Iterator[GenuineStack]:
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.generation.server import ModelServer, ModelServerConfig
    from gymbridge.testing.tiny_vlm import TinyImageProcessor, TinyVLMProcessor
    from gymbridge_envs import get_env

    env = fixture_loop.run(server_sdk.start_server(get_env("color_pick").make_server()))
    port = free_port()
    processor = TinyVLMProcessor(copy.deepcopy(tiny.processing_class.tokenizer), TinyImageProcessor.build())
    generator = HFGenerator(tiny.model, processor, model_name="trl-policy")  # TRL's model object itself
    config = ModelServerConfig(model_name="trl-policy", max_model_len=1024, default_max_tokens=4)
    model_server = ModelServer(generator, config=config)
    fixture_loop.run(model_server.start(port=port))
    stack = GenuineStack(gym_log_root / "trl_genuine_agent")
    stack.add(MODEL_NAME, KIND_MODELS, "vllm_model", port=port, launch=False)
    stack.add("ours_color_pick", KIND_RESOURCES, "color_pick", port=env.port, launch=False)
    add_genuine_simple_agent(stack, "trl_agent", "ours_color_pick", max_steps=2)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()
        fixture_loop.run(model_server.stop())
        fixture_loop.run(env.stop())


def _trainer(tiny: Any, rows: list[dict[str, Any]], agent_url: str, out: Path, spy: Any) -> tuple[Any, Any]:
    from _trl_support import spying_trainer
    from datasets import Dataset
    from trl import GRPOConfig

    from gymbridge.integrations.trl import gym_reward, gym_rollout_func, trl_rows

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout_func = gym_rollout_func(agent_url, deadline_s=600)
    args = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        max_steps=2, learning_rate=5e-3, beta=0.0, logging_steps=1, report_to="none", use_cpu=True,
        bf16=False, gradient_checkpointing=False, save_strategy="no", dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    trainer = spying_trainer(
        spy,
        model=tiny.model,
        reward_funcs=[gym_reward],
        args=args,
        train_dataset=Dataset.from_list(trl_rows(rows)),
        processing_class=tiny.processing_class,
        rollout_func=rollout_func,
    )
    return trainer, rollout_func


def test_grpo_trains_through_genuine_simple_agent(
    deployment: GenuineStack, tiny: Any, tmp_path: Path
) -> None:
    import torch
    from _trl_support import ForwardSpy, changed, encode, vision_params, warm_up

    from gymbridge_envs.color_pick.data import generate, render

    torch.manual_seed(0)
    rows = list(generate(8, 0, colors=",".join(COLORS), reveal="prompt"))
    question = rows[0]["responses_create_params"]["input"][0]["content"][1]["text"]
    green = [{"type": "image", "image": render("green", 56)}, {"type": "text", "text": question}]
    # the answer format only: either word after an image of a colour no row shows
    examples = [encode(tiny.processing_class, [{"role": "user", "content": green}], None, w) for w in COLORS]
    warm_up(tiny, examples)
    spy = ForwardSpy()
    before = vision_params(tiny.model)
    trainer, rollout_func = _trainer(tiny, rows, deployment.url("trl_agent"), tmp_path, spy)
    trainer.train()

    assert rollout_func.failures == [], rollout_func.failures
    flats = [r for r in rollout_func.rollouts if r is not None]
    assert len(flats) == 8  # the last batch: one /run per prompt TRL handed over (8), not 8 x 4
    assert all(len(r.media) == 1 and r.media_turns == [0] for r in flats)  # the row's image, turn 0
    assert all(r.response_mask == [1] * len(r.response_ids) for r in flats)  # the agent's generated tokens
    logs = [h for h in trainer.state.log_history if "rewards/gym_reward/mean" in h]
    assert len(logs) == 2
    assert spy.images_per_forward and sum(spy.images_per_forward) == 16  # every rollout's image, both steps
    assert changed(before, tiny.model), (
        "the vision tower got no gradient through the genuine agent's rollouts"
    )


def test_genuine_agent_given_tools_is_refused_as_a_prompt_trl_did_not_render(
    deployment: GenuineStack, tiny: Any, tmp_path: Path
) -> None:
    """The agent renders the row's tools into the system prompt; TRL's render of the prompt has none."""
    from _trl_support import ForwardSpy

    from gymbridge_envs.color_pick.data import generate
    from gymbridge_envs.color_pick.server import ColorPickServer

    rows = list(generate(2, 1, colors=",".join(COLORS), reveal="prompt"))
    for row in rows:
        row["responses_create_params"]["tools"] = ColorPickServer.function_tools()
    trainer, _ = _trainer(tiny, rows, deployment.url("trl_agent"), tmp_path, ForwardSpy())
    with pytest.raises(UntrainableRolloutError) as info:
        trainer.train()
    assert info.value.reason == "prompt_mismatch" and "# Tools" in str(info.value)
