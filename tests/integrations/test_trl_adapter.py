"""The TRL adapter's parts without a trainer: tool schemas, dataset rows, the template check, the refusals.

The rollout_func tests answer ``POST /run`` from an ``httpx.MockTransport`` with results built from
the tiny model's own tokens, so each refusal is exercised exactly where TRL would otherwise crash
or drop pixels; ``test_trl_train.py`` runs TRL's real ``GRPOTrainer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest

pytest.importorskip("trl", reason="the TRL adapter tests need the trl extra (pip install 'gymbridge[trl]')")

from transformers.utils import get_json_schema

from gymbridge.errors import ChatTemplateMediaError, EnvFaultError, IntegrationError, UntrainableRolloutError
from gymbridge.integrations._common import ServerThread
from gymbridge.integrations.trl import (
    GYM_ROW_KEY,
    check_tool_image_template,
    gym_environment,
    gym_reward,
    gym_rollout_func,
    tool_method,
    trl_rows,
)
from gymbridge.models.tiny_vlm import build_tiny_tokenizer, tiny_hf_processor
from gymbridge.server import VerifyResult, audio_part
from gymbridge.testing.fault_proxy import Fault, FaultProxy
from gymbridge_envs.color_pick.data import COLORS, make_row
from gymbridge_envs.color_pick.server import ColorPickServer
from gymbridge_envs.zoom_read.server import ZoomReadServer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def processor() -> Any:
    return tiny_hf_processor()


# ----------------------------------------------------------------------------- tools


@pytest.mark.parametrize(
    "spec", ZoomReadServer.function_tools() + ColorPickServer.function_tools(), ids=lambda s: s["name"]
)
def test_tool_methods_render_the_gym_schema_trl_shows_the_model(spec: dict[str, Any]) -> None:
    class Holder:
        pass

    method = tool_method(spec, lambda self, name, arguments: (name, arguments))
    setattr(Holder, method.__name__, method)
    bound = getattr(Holder(), method.__name__)
    rendered = get_json_schema(bound)["function"]
    assert rendered["name"] == spec["name"] and rendered["description"] == spec["description"]
    gym = spec["parameters"]
    assert set(rendered["parameters"]["properties"]) == set(gym["properties"])
    assert rendered["parameters"].get("required", []) == gym["required"]
    for name, prop in gym["properties"].items():
        assert rendered["parameters"]["properties"][name]["description"] == prop["description"]
    if spec["name"] == "zoom":
        assert rendered["parameters"]["properties"]["bbox"]["items"] == {"type": "integer"}
        assert bound(bbox=[1, 2, 3, 4]) == ("zoom", {"bbox": [1, 2, 3, 4]})
    if spec["name"] == "answer":
        assert sorted(rendered["parameters"]["properties"]["value"]["type"]) == ["integer", "string"]


def test_tool_method_keeps_enums_and_optional_arguments() -> None:
    spec = {
        "type": "function",
        "name": "move",
        "description": "Move.",
        "parameters": {
            "type": "object",
            "properties": {
                "direction": {"type": "string", "enum": ["north", "south"], "description": "where"},
                "steps": {"type": "integer", "description": "how far"},
            },
            "required": ["direction"],
        },
    }
    calls: list[Any] = []
    method = tool_method(spec, lambda self, name, arguments: calls.append(arguments))
    rendered = get_json_schema(method)["function"]["parameters"]
    assert rendered["properties"]["direction"]["enum"] == ["north", "south"]
    assert rendered["required"] == ["direction"]
    method(None, direction="north")
    assert calls == [{"direction": "north"}]  # an optional argument the model left out is not posted


@pytest.mark.parametrize(
    ("name", "arg"), [("reset", "x"), ("get_reward", "x"), ("_hidden", "x"), ("ok", "class"), ("ok", "a-b")]
)
def test_tool_method_refuses_what_trl_cannot_expose(name: str, arg: str) -> None:
    spec = {
        "type": "function",
        "name": name,
        "parameters": {"type": "object", "properties": {arg: {"type": "string"}}},
    }
    with pytest.raises(IntegrationError):
        tool_method(spec, lambda self, n, a: None)


# ----------------------------------------------------------------------------- rows


def test_trl_rows_keep_the_image_in_place_and_the_gym_row() -> None:
    row = make_row(0, 0, colors="red,blue", reveal="prompt")
    (out,) = trl_rows([row])
    assert [b["type"] for b in out["prompt"][0]["content"]] == ["image", "text"]
    assert out["images"][0].getpixel((5, 5)) == COLORS[row["color"]]
    assert orjson.loads(out["prompt"][0][GYM_ROW_KEY]) == row


def test_trl_rows_refuse_audio_which_trl_cannot_carry() -> None:
    row = {"responses_create_params": {"input": [{"role": "user", "content": [audio_part(b"RIFF....")]}]}}
    with pytest.raises(UntrainableRolloutError) as info:
        trl_rows([row])
    assert info.value.reason == "unsupported_media"


# ----------------------------------------------------------------------------- template check


def test_check_passes_the_tiny_template_and_counts_one_images_tokens(processor: Any) -> None:
    assert check_tool_image_template(processor) == 4  # a 64x64 probe -> 56x56 -> 4 merged tokens


def test_check_refuses_a_template_that_drops_tool_images() -> None:
    """Qwen2/2.5-VL-style templates print a tool message's text only: TRL would drop the batch's pixels."""
    tokenizer = build_tiny_tokenizer()
    tool_branch = "{% elif message['role'] == 'tool' %}"
    start = tokenizer.chat_template.index(tool_branch)
    end = tokenizer.chat_template.index("{% else %}<|im_start|>{{ message['role'] }}", start)
    text_only = (
        tool_branch + "<|im_start|>user\n<tool_response>\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}\n</tool_response><|im_end|>\n"
    )
    tokenizer.chat_template = tokenizer.chat_template[:start] + text_only + tokenizer.chat_template[end:]
    dropping = tiny_hf_processor(tokenizer)
    with pytest.raises(ChatTemplateMediaError) as info:
        check_tool_image_template(dropping)
    assert (info.value.expected, info.value.found) == (4, 0)
    with pytest.raises(ChatTemplateMediaError):  # before any environment session or trainer exists
        gym_environment(ColorPickServer, processing_class=dropping)


# ----------------------------------------------------------------------------- environment sessions


def test_environment_session_seeds_calls_offered_tools_and_verifies(processor: Any) -> None:
    row = make_row(0, 1, colors="red,green", reveal="tool")
    (trl_row,) = trl_rows([row])
    with gym_environment(ColorPickServer, processing_class=processor) as env:
        session = env()
        public = sorted(
            n for n in dir(type(session)) if not n.startswith("_") and callable(getattr(session, n))
        )
        assert public == ["look", "reset"]  # TRL makes every public function but reset a tool
        session.reset(**trl_row)
        blocks = session.look()
        assert blocks[0] == {"type": "text", "text": "The image:"}
        assert blocks[1]["type"] == "image" and blocks[1]["image"].getpixel((3, 3)) == COLORS[row["color"]]
        call = {"type": "function", "function": {"name": "look", "arguments": {}}}
        completion = [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "look", "content": blocks},
            {"role": "assistant", "content": row["color"]},
        ]
        wrong = [*completion[:2], {"role": "assistant", "content": "blue"}]
        other = env()
        other.reset(**trl_row)
        other.look()
        assert env.reward_func([completion, wrong], environments=[session, other]) == [1.0, 0.0]
        assert env.failures == []


def test_environment_records_a_failed_session_and_scores_it_none(processor: Any) -> None:
    row = make_row(0, 0, colors="red,green", reveal="tool")
    (trl_row,) = trl_rows([row])
    with gym_environment(ColorPickServer, processing_class=processor) as env:
        good, bad = env(), env()
        good.reset(**trl_row)
        bad_row = {
            **trl_row,
            "prompt": [{**trl_row["prompt"][0], GYM_ROW_KEY: json.dumps({**row, "color": "mauve"})}],
        }
        bad.reset(**bad_row)  # /seed_session answers 422: recorded, not raised through TRL
        assert "error" in json.loads(bad.look())
        completion = [{"role": "assistant", "content": "red"}]
        assert env.reward_func([completion, completion], environments=[good, bad])[1] is None
        assert len(env.failures) == 1 and "seed_session" in env.failures[0]["reason"]
        with pytest.raises(Exception, match="every rollout of the batch failed"):
            env.reward_func([completion], environments=[bad])


@contextlib.contextmanager
def _fault_proxy(upstream: str, faults: dict[str, Fault]) -> Iterator[FaultProxy]:
    """A FaultProxy on a loop of its own (the TRL environment's calls are synchronous)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    proxy = FaultProxy(upstream, faults)
    asyncio.run_coroutine_threadsafe(proxy.__aenter__(), loop).result(30)
    try:
        yield proxy
    finally:
        asyncio.run_coroutine_threadsafe(proxy.__aexit__(None, None, None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_environment_fault_fails_the_session_but_a_tools_500_is_its_answer(processor: Any) -> None:
    """gymbridge.faults: a 502 mid-episode is never trained; a 500 is the tool's own answer, shown."""
    row = make_row(0, 0, colors="red,green", reveal="tool")
    (trl_row,) = trl_rows([row])
    completion = [{"role": "assistant", "content": row["color"]}]
    with ServerThread(ColorPickServer()) as upstream:
        faults = {"/look": Fault(502, times=1)}
        with (
            _fault_proxy(upstream.url, faults) as proxy,
            gym_environment(
                proxy.url, processing_class=processor, tools=ColorPickServer.function_tools()
            ) as env,
        ):
            faulted, fine = env(), env()
            faulted.reset(**trl_row)
            with pytest.raises(EnvFaultError, match="HTTP 502"):
                faulted.look()  # TRL shows the model the error; the session is over
            fine.reset(**trl_row)
            fine.look()  # forwarded: the fault was injected once
            assert env.reward_func([completion, completion], environments=[faulted, fine]) == [None, 1.0]
            assert len(env.failures) == 1 and "tool look" in env.failures[0]["reason"]
            assert env.failures[0]["kind"] == "EnvFaultError"
        with (
            _fault_proxy(upstream.url, {"/look": Fault(500, times=1)}) as proxy,
            gym_environment(
                proxy.url, processing_class=processor, tools=ColorPickServer.function_tools()
            ) as env,
        ):
            session = env()
            session.reset(**trl_row)
            assert isinstance(session.look(), str)  # the 500's body, for the model to read
            assert env.reward_func([completion], environments=[session]) == [1.0]
            assert env.failures == []


class _MaskingColorPick(ColorPickServer):
    async def verify(self, session: Any, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        return VerifyResult(
            reward=0.0, mask_sample=True, failure_kind="judge_failed", failure_reason="no judge"
        )


def test_environment_scores_a_masked_verify_none_and_records_it(processor: Any) -> None:
    row = make_row(0, 0, colors="red,green", reveal="tool")
    (trl_row,) = trl_rows([row])
    with gym_environment(_MaskingColorPick, processing_class=processor) as env:
        session = env()
        session.reset(**trl_row)
        completion = [{"role": "assistant", "content": row["color"]}]
        with pytest.raises(Exception, match="every rollout of the batch failed"):
            env.reward_func([completion], environments=[session])
        assert (
            env.failures[0]["kind"] == "mask_sample" and "judge_failed: no judge" in env.failures[0]["reason"]
        )


# ----------------------------------------------------------------------------- rollout_func


def _trainer(processing_class: Any) -> Any:
    return SimpleNamespace(processing_class=processing_class, tools=[], chat_template_kwargs={})


def _tokens(processor: Any, text: str) -> list[int]:
    return [int(t) for t in processor.tokenizer(text, add_special_tokens=False)["input_ids"]]


def _message(prompt: list[int], generation: list[int], text: str = "red") -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "id": "msg_1",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [-0.5] * len(generation),
    }


class FakeAgent:
    """``POST /run``: answers each row with ``answer(row, prompt_ids)``; records the rows."""

    def __init__(self, processor: Any, answer: Any) -> None:
        self.processor = processor
        self.answer = answer
        self.rows: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        row = json.loads(request.content)
        self.rows.append(row)
        body = self.answer(row)
        if isinstance(body, httpx.Response):
            return body
        return httpx.Response(200, json={**row, "response": {"output": body}, "reward": 1.0})


def _rollout(processor: Any, answer: Any, prompts: list[Any]) -> tuple[dict[str, Any], FakeAgent, Any]:
    agent = FakeAgent(processor, answer)
    func = gym_rollout_func("http://agent.test", max_attempts=1)
    func.transport = httpx.MockTransport(agent)
    return func(prompts, _trainer(processor)), agent, func


def _prompts(rows: list[dict[str, Any]], group: int) -> list[Any]:
    """What TRL 1.16 hands a rollout_func: each dataset prompt ``group`` times, images filled in."""
    from trl.data_utils import prepare_multimodal_messages

    out = []
    for trl_row in trl_rows(rows):
        prompt = prepare_multimodal_messages(trl_row["prompt"], images=trl_row["images"])
        out += [prompt] * group
    return out


def test_regression_rollout_func_runs_each_repeated_prompt_once(processor: Any) -> None:
    """TRL repeats prompts before calling rollout_func; TRL's removed example expanded them again (G x G)."""
    from gymbridge.integrations.trl import _trl_prompt_ids

    rows = [make_row(0, i, colors="red,blue", reveal="prompt") for i in range(2)]
    prompts = _prompts(rows, 3)
    answer_ids = _tokens(processor, "red<|im_end|>")

    def answer(row: dict[str, Any]) -> Any:
        prompt = next(p for p in prompts if json.loads(p[0][GYM_ROW_KEY])["color"] == row["color"])
        return [_message(_trl_prompt_ids(prompt, _trainer(processor)), answer_ids)]

    out, agent, func = _rollout(processor, answer, prompts)
    assert len(agent.rows) == 6 and all(len(out[k]) == 6 for k in out)
    assert [r["_ng_rollout_index"] for r in agent.rows if r["color"] == rows[0]["color"]] == [0, 1, 2]
    assert out["completion_ids"][0] == answer_ids and out["env_mask"][0] == [1] * len(answer_ids)
    assert out["gym_reward"] == [1.0] * 6 and func.failures == []
    assert gym_reward(out["completion_ids"], gym_reward=out["gym_reward"]) == [1.0] * 6


@pytest.mark.parametrize("first", ["refused", "masked"])
def test_rollout_func_records_a_failed_or_masked_rollout_without_training_it(
    processor: Any, first: str
) -> None:
    """A /run the agent refused (422), or a result marked mask_sample (its reward is no measurement)."""
    from gymbridge.integrations.trl import _trl_prompt_ids

    rows = [make_row(0, 0, colors="red,blue", reveal="prompt")]
    prompts = _prompts(rows, 2)
    rendered = _trl_prompt_ids(prompts[0], _trainer(processor))
    seen: list[int] = []

    def answer(row: dict[str, Any]) -> Any:
        seen.append(1)
        output = [_message(rendered, _tokens(processor, "red<|im_end|>"))]
        if len(seen) == 1 and first == "refused":
            return httpx.Response(422, text="bad row")
        if len(seen) == 1:
            masked = {"mask_sample": True, "failure_kind": "judge_failed", "failure_reason": "no judge"}
            return httpx.Response(200, json={**row, "response": {"output": output}, "reward": 0.0, **masked})
        return output

    out, _, func = _rollout(processor, answer, prompts)
    failed = out["gym_reward"].index(None)  # whichever /run the agent answered first
    assert out["gym_reward"][1 - failed] == 1.0
    assert out["env_mask"][failed] == [0] and out["prompt_ids"][failed] == rendered
    assert [f["kind"] for f in func.failures] == ["data" if first == "refused" else "mask_sample"]
    if first == "masked":
        assert out["gym_failure"][failed] == "mask_sample: judge_failed: no judge"


def _image_run(processor: Any, n: int = 4) -> list[int]:
    return [processor.image_token_id] * n


def test_rollout_func_refuses_media_after_the_first_model_call(processor: Any) -> None:
    row = make_row(0, 0, colors="red,blue", reveal="tool")
    prompts = _prompts([row], 1)
    first = _tokens(processor, "<|im_start|>user\nlook<|im_end|>\n<|im_start|>assistant\n")
    call = _tokens(processor, '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call><|im_end|>')
    delta = (
        _tokens(processor, "\n<|im_start|>user\n<tool_response>\n<|vision_start|>")
        + _image_run(processor)
        + _tokens(processor, "<|vision_end|>\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    )
    image = make_row(0, 0, reveal="prompt")["responses_create_params"]["input"][0]["content"][0]

    def answer(_: dict[str, Any]) -> Any:
        return [
            {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}",
             "prompt_token_ids": first, "generation_token_ids": call,
             "generation_log_probs": [-0.1] * len(call)},
            {"type": "function_call_output", "call_id": "c1",
             "output": [{"type": "input_text", "text": "x"}, image]},
            _message(first + call + delta, _tokens(processor, "red<|im_end|>")),
        ]  # fmt: skip

    with pytest.raises(UntrainableRolloutError) as info:
        _rollout(processor, answer, prompts)
    assert info.value.reason == "mid_episode_media" and info.value.row == 0


def test_rollout_func_refuses_a_history_that_does_not_only_append(processor: Any) -> None:
    prompts = _prompts([make_row(0, 0, colors="red,blue", reveal="tool")], 1)
    first = _tokens(processor, "<|im_start|>user\nlook<|im_end|>\n<|im_start|>assistant\n")
    gen = _tokens(processor, "red<|im_end|>")

    def answer(_: dict[str, Any]) -> Any:
        rewritten = _tokens(processor, "<|im_start|>user\nsummary<|im_end|>\n<|im_start|>assistant\n")
        return [
            _message(first, gen),
            {"type": "message", "role": "user", "content": "again"},
            _message(rewritten, gen),
        ]

    with pytest.raises(UntrainableRolloutError) as info:
        _rollout(processor, answer, prompts)
    assert info.value.reason == "noncontiguous"


def test_rollout_func_refuses_a_prompt_trl_did_not_render(processor: Any) -> None:
    """An agent's own system prompt: TRL would take pixels from its render, misaligned with these tokens."""
    from gymbridge.integrations.trl import _trl_prompt_ids

    prompts = _prompts([make_row(0, 0, colors="red,blue", reveal="prompt")], 1)
    rendered = _trl_prompt_ids(prompts[0], _trainer(processor))
    system = _tokens(processor, "You are a helpful assistant.")
    at = next(i for i in range(len(rendered)) if rendered[i : i + len(system)] == system)
    agent_prompt = rendered[:at] + _tokens(processor, "Answer tersely.") + rendered[at + len(system) :]

    def answer(_: dict[str, Any]) -> Any:
        return [_message(agent_prompt, _tokens(processor, "red<|im_end|>"))]

    with pytest.raises(UntrainableRolloutError) as info:
        _rollout(processor, answer, prompts)
    assert info.value.reason == "prompt_mismatch" and "Answer tersely" in str(info.value)


def test_regression_the_tests_vllm_folder_does_not_pass_for_vllm() -> None:
    """tests/vllm on sys.path made TRL see a vLLM of version 'N/A' and fail to import its trainer."""
    import importlib.util

    spec = importlib.util.find_spec("vllm") if sys.modules.get("vllm", ...) is not None else None
    assert spec is None or spec.loader is not None  # absent, or a real installation
    from trl import GRPOTrainer

    assert GRPOTrainer.__name__ == "GRPOTrainer"
