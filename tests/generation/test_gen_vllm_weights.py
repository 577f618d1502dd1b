"""VLLMGenerator around vLLM, with stand-ins: placeholders sent once and checked after, and the weight sync.

vLLM is not installed in this venv (tests/vllm checks the real package, in .venv-vllm); what
surrounds it is tested against fakes that behave like AsyncLLM's API: ``TokensPrompt`` dicts,
``RequestOutput.prompt_token_ids`` (the prompt vLLM ran, placeholders expanded by its own
processor), ``collective_rpc``, pause / resume and the cache resets, and the worker extension's
methods. The worker's weight receive runs over a real gloo group.
"""

from __future__ import annotations

import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.errors import WeightSyncError
from gymbridge.generation import vllm as vllm_backend
from gymbridge.generation.types import SamplingConfig
from gymbridge.generation.weights import (
    Bucket,
    bucket_tensors,
    named_weights,
    open_weight_group,
    plan_buckets,
    weight_store,
)
from gymbridge.trajectory.types import GenerationInput

IMAGE, VIDEO = 50, 51


@dataclass
class Logprob:
    logprob: float


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str = "stop"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]
    finished: bool = True


@dataclass
class Engine:
    """Expands each placeholder once per image by ``expand`` tokens, like vLLM's processor."""

    expand: int = 3
    world_size: int = 1
    prompts: list[Any] = field(default_factory=list)
    rpcs: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    cache_resets: int = 0
    encoder_resets: int = 0
    paused: bool = False

    def __post_init__(self) -> None:
        self.model_config = types.SimpleNamespace(
            hf_config=types.SimpleNamespace(image_token_id=IMAGE, video_token_id=VIDEO), max_model_len=256
        )
        self.vllm_config = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(world_size=self.world_size)
        )

    async def generate(self, prompt: Any, params: Any, request_id: str) -> Any:
        self.prompts.append(prompt)
        ran: list[int] = []
        for t in prompt["prompt_token_ids"]:
            ran.extend([t] * (self.expand if t in (IMAGE, VIDEO) else 1))
        yield RequestOutput(request_id, ran, [Completion([7, 2], [{7: Logprob(-0.5)}, {2: Logprob(-0.1)}])])

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.rpcs.append((method, args))
        return [None] * self.world_size

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.paused = True

    async def resume_generation(self) -> None:
        self.paused = False

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        assert reset_running_requests and self.paused
        self.cache_resets += 1
        return True

    async def reset_encoder_cache(self) -> None:
        assert self.paused
        self.encoder_resets += 1


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    vllm.AsyncEngineArgs = dict  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


def make(engine: Engine) -> vllm_backend.VLLMGenerator:
    return vllm_backend.VLLMGenerator("some/model", engine=engine, load_processor=False)


def expanded(n_per_item: int, items: int) -> list[int]:
    out = [1]
    for _ in range(items):
        out += [60, *([IMAGE] * n_per_item), 61, 9]
    return out


def test_placeholder_ids_come_from_the_model_config() -> None:
    cfg = types.SimpleNamespace(image_token_id=5, text_config=types.SimpleNamespace(video_token_index=6))
    assert vllm_backend.placeholder_token_ids(cfg) == {"image": 5, "video": 6}


def test_each_media_item_is_sent_with_one_placeholder(fake_vllm: None) -> None:
    images = [object(), object()]
    inp = GenerationInput(prompt_token_ids=expanded(3, 2), multi_modal_data={"image": images})
    prompt, _ = make(Engine()).build_request(inp, SamplingConfig())
    assert prompt["prompt_token_ids"] == expanded(1, 2)
    assert prompt["multi_modal_data"] == {"image": images}


def test_a_prompt_whose_runs_disagree_with_its_media_is_refused(fake_vllm: None) -> None:
    inp = GenerationInput(prompt_token_ids=expanded(3, 2), multi_modal_data={"image": [object()]})
    with pytest.raises(vllm_backend.VLLMGenerationError, match="2 run"):
        make(Engine()).build_request(inp, SamplingConfig())


async def test_the_prompt_vllm_ran_equals_the_recorded_one(fake_vllm: None) -> None:
    inp = GenerationInput(prompt_token_ids=expanded(3, 2), multi_modal_data={"image": [object(), object()]})
    (gen,) = await make(Engine(expand=3)).generate([inp], SamplingConfig())
    assert gen.prompt_token_ids == inp.prompt_token_ids and gen.token_ids == [7, 2]


async def test_regression_double_expanded_prompt_is_an_error(fake_vllm: None) -> None:
    """vLLM expanding an already expanded prompt again must fail loudly, naming where."""
    inp = GenerationInput(prompt_token_ids=expanded(3, 1), multi_modal_data={"image": [object()]})
    with pytest.raises(vllm_backend.VLLMGenerationError, match="first difference at position 5"):
        await make(Engine(expand=4)).generate([inp], SamplingConfig())


@given(st.lists(st.one_of(st.integers(100, 120), st.integers(1, 5).map(lambda n: [IMAGE] * n)), max_size=12))
def test_collapsing_keeps_text_and_leaves_one_placeholder_per_run(parts: list[Any]) -> None:
    prompt: list[int] = []
    runs = 0
    for part in parts:
        if isinstance(part, list):
            if prompt and prompt[-1] == IMAGE:
                prompt.append(100)  # runs must be separated to count as two items
            prompt.extend(part)
            runs += 1
        else:
            prompt.append(part)
    out = vllm_backend.collapse_placeholders(prompt, {"image": runs}, {"image": IMAGE})
    assert [t for t in out if t != IMAGE] == [t for t in prompt if t != IMAGE]
    assert out.count(IMAGE) == runs
    assert vllm_backend.collapse_placeholders(prompt, {}, {"image": IMAGE}) == prompt  # no media: untouched


async def test_the_sink_drives_every_worker_and_stamps_the_version(fake_vllm: None) -> None:
    engine = Engine(world_size=2)
    gen = make(engine)
    sink = vllm_backend.VLLMWeightSink(gen)
    assert sink.ranks == 2 and sink.policy_version == 0
    model = torch.nn.Linear(3, 2)
    buckets = plan_buckets(named_weights(model))
    sink.check([s for b in buckets for s in b.specs])
    with pytest.raises(WeightSyncError, match="twice"):
        sink.check([buckets[0].specs[0], buckets[0].specs[0]])
    await sink.receive(4, buckets, timeout_s=5)
    method, args = engine.rpcs[-1]
    assert method == "gymbridge_receive_weights"
    assert [Bucket.from_json(b) for b in args[0]] == buckets
    assert engine.cache_resets == engine.encoder_resets == 1 and gen.policy_version == 4
    assert not engine.paused
    inp = GenerationInput(prompt_token_ids=[1, 2])
    assert (await gen.generate([inp], SamplingConfig()))[0].policy_version == 4


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights: Any) -> None:
        self.loaded.extend((n, t.clone()) for n, t in weights)


def test_the_worker_extension_receives_buckets_over_a_real_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_backend, "_worker_world_rank", lambda: 0)
    source = torch.nn.Linear(4, 3)
    buckets = plan_buckets(named_weights(source), bucket_bytes=16)  # one tensor per bucket
    store = weight_store("127.0.0.1", 0, world_size=2, is_host=True, timeout_s=30)
    sent: list[BaseException] = []

    def trainer() -> None:
        try:
            group = open_weight_group(store, rank=0, world_size=2, backend="gloo", timeout_s=30)
            tensors = dict(named_weights(source))
            for b in buckets:
                group.broadcast(bucket_tensors(b, [tensors[s.name] for s in b.specs], torch.device("cpu")))
            group.close()
        except BaseException as exc:  # surfaced by the assertion below
            sent.append(exc)

    thread = threading.Thread(target=trainer)
    thread.start()
    ext = vllm_backend.WeightSyncWorkerExtension()
    model = Model()
    ext.model_runner = types.SimpleNamespace(model=model)
    assert ext.gymbridge_join_weight_group("127.0.0.1", int(store.port), 1, 2, "gloo", 30) == 1
    assert ext.gymbridge_receive_weights([b.to_json() for b in buckets], 30) == 2
    thread.join(30)
    assert not sent
    got = dict(model.loaded)
    for name, tensor in source.state_dict().items():
        torch.testing.assert_close(got[name], tensor)


def test_a_worker_without_a_group_refuses_to_receive() -> None:
    ext = vllm_backend.WeightSyncWorkerExtension()
    ext.model_runner = types.SimpleNamespace(model=Model())
    with pytest.raises(WeightSyncError, match="not joined"):
        ext.gymbridge_receive_weights([], 1)
