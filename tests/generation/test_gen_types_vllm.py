"""SamplingConfig / Generation invariants, and VLLMGenerator on CPU against a stand-in vLLM module."""

from __future__ import annotations

import asyncio
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
from PIL import Image

from gymbridge.generation import vllm as vllm_backend
from gymbridge.generation.types import ContextLengthError, Generation, SamplingConfig, fit_max_tokens
from gymbridge.trajectory.types import GenerationInput


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_sampling_config_rejects_nonsense(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingConfig(**kwargs)


def test_generation_requires_one_logprob_per_token() -> None:
    with pytest.raises(ValueError, match="2 generated tokens but 1 logprobs"):
        Generation([1, 2], [-0.5], "stop")


def test_fit_max_tokens_follows_vllm() -> None:
    s = SamplingConfig(max_tokens=100)
    assert fit_max_tokens(10, s, 50).max_tokens == 40
    assert fit_max_tokens(10, s, 500) is s
    with pytest.raises(ContextLengthError, match="maximum context length is 50 tokens"):
        fit_max_tokens(50, s, 50)


# ---------------------------------------------------------------- a stand-in vllm module


@dataclass
class FakeSamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None


@dataclass
class FakeLogprob:
    logprob: float
    rank: int = 1


@dataclass
class FakeCompletion:
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion]
    finished: bool = True


class FakeEngine:
    """``AsyncLLM``'s surface as gymbridge uses it; ``calls`` records the order of the engine calls."""

    def __init__(self, prefix_reset: Any = True) -> None:
        self.requests: list[tuple[Any, Any, str]] = []
        self.rpcs: list[tuple[str, Any]] = []
        self.calls: list[str] = []
        self.cache_resets = 0
        self.prefix_reset = prefix_reset

    async def generate(self, prompt: Any, params: Any, request_id: str) -> Any:
        self.requests.append((prompt, params, request_id))
        toks = [7, 8, 2]
        yield FakeRequestOutput(
            request_id,
            prompt["prompt_token_ids"],
            [FakeCompletion(toks[:1], [{7: FakeLogprob(-0.1)}], None)],
            False,
        )
        lps = [{7: FakeLogprob(-0.1), 99: FakeLogprob(-3.0)}, {8: FakeLogprob(-0.2)}, {2: FakeLogprob(-0.3)}]
        yield FakeRequestOutput(request_id, prompt["prompt_token_ids"], [FakeCompletion(toks, lps, "stop")])

    async def collective_rpc(self, method: str, args: Any = ()) -> list[int]:
        self.rpcs.append((method, args))
        self.calls.append(method)
        return [len(args[0])]

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(f"pause:{mode}")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> Any:
        self.calls.append(f"reset_prefix:{reset_running_requests}")
        self.cache_resets += 1
        return self.prefix_reset

    async def reset_encoder_cache(self) -> None:
        self.calls.append("reset_encoder")


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Any:
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = FakeSamplingParams  # type: ignore[attr-defined]
    vllm.AsyncEngineArgs = dict  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    return vllm


def make_gen(engine: Any) -> vllm_backend.VLLMGenerator:
    return vllm_backend.VLLMGenerator("some/model", engine=engine, max_model_len=128, load_processor=False)


def test_missing_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"gymbridge\[vllm\]"):
        vllm_backend.VLLMGenerator("some/model")


def test_request_carries_all_media_and_sampled_token_logprobs(fake_vllm: Any) -> None:
    images = [Image.new("RGB", (8, 8)), Image.new("RGB", (4, 4))]
    inp = GenerationInput(prompt_token_ids=[1, 5, 5, 5, 9], multi_modal_data={"image": images})
    prompt, params = make_gen(FakeEngine()).build_request(
        inp, SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=12, stop_token_ids=(2,), seed=3)
    )
    assert prompt == {"prompt_token_ids": [1, 5, 5, 5, 9], "multi_modal_data": {"image": images}}
    assert params == FakeSamplingParams(
        n=1,
        temperature=0.7,
        top_p=0.9,
        max_tokens=12,
        stop_token_ids=[2],
        seed=3,
        logprobs=0,
        detokenize=False,
        skip_special_tokens=False,
    )


def test_request_never_lets_vllm_sample_media_placeholders(fake_vllm: Any) -> None:
    """Every request bans the media placeholder / vision boundary ids with a -inf logit bias."""
    engine = FakeEngine()
    engine.model_config = types.SimpleNamespace(  # type: ignore[attr-defined]
        hf_config=types.SimpleNamespace(
            image_token_id=151655,
            video_token_id=151656,
            vision_start_token_id=151652,
            vision_end_token_id=151653,
            eos_token_id=151645,
        ),
        max_model_len=128,
    )
    gen = vllm_backend.VLLMGenerator(
        "some/model", engine=engine, load_processor=False, suppress_token_ids=[7]
    )
    assert gen.suppressed_token_ids == (7, 151652, 151653, 151655, 151656)
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0.0, seed=1)):
        _, params = gen.build_request(GenerationInput(prompt_token_ids=[1, 2]), sampling)
        assert params.logit_bias == {t: float("-inf") for t in (7, 151652, 151653, 151655, 151656)}
        assert params.logprobs == 0  # the sampled token's processed logprob (masked distribution)
    # an engine without an HF config and no extra ids: no bias at all (vLLM's default)
    _, params = make_gen(FakeEngine()).build_request(GenerationInput(prompt_token_ids=[1]), SamplingConfig())
    assert params.logit_bias is None


def test_text_only_request_has_no_multi_modal_data(fake_vllm: Any) -> None:
    prompt, _ = make_gen(FakeEngine()).build_request(
        GenerationInput(prompt_token_ids=[1, 2]), SamplingConfig()
    )
    assert prompt == {"prompt_token_ids": [1, 2]}


async def test_generate_converts_the_final_output(fake_vllm: Any) -> None:
    engine = FakeEngine()
    gens = await make_gen(engine).generate(
        [GenerationInput(prompt_token_ids=[1, 2, 3])], SamplingConfig(max_tokens=500)
    )
    assert gens == [Generation([7, 8, 2], [-0.1, -0.2, -0.3], "stop", [1, 2, 3], policy_version=0)]
    assert engine.requests[0][1].max_tokens == 125  # lowered to fit the 128-token context


async def test_context_overflow_is_refused_before_the_engine(fake_vllm: Any) -> None:
    engine = FakeEngine()
    with pytest.raises(ContextLengthError):
        await make_gen(engine).generate(
            [GenerationInput(prompt_token_ids=list(range(128)))], SamplingConfig()
        )
    assert engine.requests == []


@pytest.mark.parametrize(
    ("completion", "needle"),
    [
        (FakeCompletion([1, 2], [{1: FakeLogprob(-1.0)}], "stop"), "2 tokens but 1 logprob"),
        (FakeCompletion([1], [{5: FakeLogprob(-1.0)}], "stop"), "no logprob for sampled token 0"),
        (FakeCompletion([1], [{1: FakeLogprob(-1.0)}], "abort"), "finished with 'abort'"),
        (FakeCompletion([1], None, "stop"), "0 logprob entries"),
    ],
)
def test_bad_outputs_raise_typed_errors(completion: Any, needle: str) -> None:
    with pytest.raises(vllm_backend.VLLMGenerationError, match=needle):
        vllm_backend.generation_from_output(FakeRequestOutput("r", [1], [completion]))


def test_length_finish_is_kept() -> None:
    out = FakeRequestOutput("r", [1], [FakeCompletion([4], [{4: FakeLogprob(-2.0)}], "length")])
    assert vllm_backend.generation_from_output(out).finish_reason == "length"


async def test_update_weights_reaches_every_worker_and_resets_the_cache(fake_vllm: Any) -> None:
    import torch

    engine = FakeEngine()
    gen = make_gen(engine)
    n = await gen.update_weights([("w", torch.ones(2, requires_grad=True))], version=3)
    assert n == 1 and gen.policy_version == 3
    assert engine.calls == [
        "pause:keep",
        "gymbridge_load_bucket",
        "reset_prefix:True",
        "reset_encoder",
        "resume",
    ]
    _, (bucket, payload) = engine.rpcs[0]
    assert bucket == {"dtype": "float32", "tensors": [{"name": "w", "shape": [2], "dtype": "float32"}]}
    assert isinstance(payload, bytes) and len(payload) == 8


async def test_update_weights_arrive_in_the_worker_bucket_by_bucket(fake_vllm: Any) -> None:
    """What update_weights sends (JSON + bytes) is what the worker extension loads, value for value."""
    import torch

    engine = FakeEngine()
    source = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    await make_gen(engine).update_weights(source.named_parameters(), bucket_bytes=24)
    assert len(engine.rpcs) > 2  # bounded buckets: several calls
    loaded: list[tuple[str, Any]] = []

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))

        def load_weights(self, weights: Any) -> None:
            loaded.extend((n, t.clone()) for n, t in weights)

    ext = vllm_backend.WeightSyncWorkerExtension()
    ext.model_runner = types.SimpleNamespace(model=Model())
    for method, args in engine.rpcs:
        getattr(ext, method)(*args)
    got = dict(loaded)
    assert list(got) == [n for n, _ in source.named_parameters()]
    for name, tensor in source.named_parameters():
        assert got[name].dtype == torch.bfloat16
        torch.testing.assert_close(got[name], tensor.detach())


async def test_regression_a_refused_prefix_cache_reset_fails_the_update(fake_vllm: Any) -> None:
    """Bug: ``reset_prefix_cache()`` returning False (requests running) was ignored: stale KV reused."""
    import torch

    from gymbridge.errors import WeightSyncError

    engine = FakeEngine(prefix_reset=False)
    gen = make_gen(engine)
    with pytest.raises(WeightSyncError, match="did not reset its prefix cache"):
        await gen.update_weights([("w", torch.ones(2))], version=1)
    assert gen.policy_version == 0  # the version is not claimed
    assert engine.calls[-1] == "resume"  # generation is never left paused


async def test_regression_encoder_cache_is_reset_after_new_weights(fake_vllm: Any) -> None:
    """Bug: vision / audio encoder outputs of the old weights were reused for the same media."""
    import torch

    engine = FakeEngine()
    await make_gen(engine).update_weights([("w", torch.ones(1))])
    assert engine.calls.index("gymbridge_load_bucket") < engine.calls.index("reset_encoder")
    assert engine.calls.index("reset_encoder") < engine.calls.index("resume")


async def test_requests_submitted_during_a_swap_record_the_new_version(fake_vllm: Any) -> None:
    engine = FakeEngine()
    gen = make_gen(engine)
    release = asyncio.Event()

    async def slow_load() -> None:
        await release.wait()

    swap = asyncio.create_task(gen.swap_weights(slow_load, version=5))
    await asyncio.sleep(0)
    request = asyncio.create_task(gen.generate([GenerationInput(prompt_token_ids=[1, 2])], SamplingConfig()))
    await asyncio.sleep(0.01)
    assert not request.done() and engine.requests == []  # held until the swap ends
    release.set()
    await swap
    assert (await request)[0].policy_version == 5


def test_worker_extension_refuses_a_truncated_bucket() -> None:
    import torch

    from gymbridge.errors import WeightSyncError

    ext = vllm_backend.WeightSyncWorkerExtension()
    ext.model_runner = types.SimpleNamespace(model=torch.nn.Linear(1, 1))
    bucket = {"dtype": "float32", "tensors": [{"name": "w", "shape": [2], "dtype": "float32"}]}
    with pytest.raises(WeightSyncError, match="needs 8 bytes, got 4"):
        ext.gymbridge_load_bucket(bucket, b"\0" * 4)


@pytest.mark.gpu
async def test_real_vllm_engine_generates_with_logprobs() -> None:  # pragma: no cover - needs a GPU + vllm
    pytest.importorskip("vllm")
    import os

    path = os.environ.get("GYMBRIDGE_VLLM_TEST_MODEL")
    if not path:
        pytest.skip("set GYMBRIDGE_VLLM_TEST_MODEL to a local model directory")
    gen = vllm_backend.VLLMGenerator(path, engine_args={"gpu_memory_utilization": 0.3, "enforce_eager": True})
    assert gen.codec is not None
    from gymbridge.generation.chat import chat_to_messages
    from gymbridge.generation.outputs import generation_input_from_prompt

    rendered = gen.codec.render(chat_to_messages([{"role": "user", "content": "Say hi."}]))
    out = await gen.generate(
        [generation_input_from_prompt(rendered.prompt_token_ids, [])], SamplingConfig(max_tokens=8, seed=0)
    )
    assert len(out[0].token_ids) == len(out[0].logprobs) > 0


def test_media_special_token_ids_reads_every_known_spelling() -> None:
    from gymbridge.generation.types import media_special_token_ids

    qwen = types.SimpleNamespace(image_token_id=9, video_token_id=8, vision_start_token_id=7, eos_token_id=2)
    assert media_special_token_ids(qwen) == (7, 8, 9)
    llava = types.SimpleNamespace(
        image_token_index=32000, text_config=types.SimpleNamespace(audio_token_id=5)
    )
    assert media_special_token_ids(llava) == (5, 32000)
    gemma = types.SimpleNamespace(
        image_token_index=4, boi_token_index=3, eoi_token_index=6, vision_token_id=None
    )
    assert media_special_token_ids(gemma) == (3, 4, 6)
    assert media_special_token_ids(types.SimpleNamespace(eos_token_id=2, use_cache=True)) == ()


async def test_regression_rows_of_a_seeded_call_get_seeds_of_their_own(fake_vllm: Any) -> None:
    """Every row of a seeded call went to vLLM with the same seed, so a group of G rows of one
    prompt asked in one call drew G identical samples. Row j now goes with ``row_seed(seed, j)``
    (row 0: the seed itself), as in every row-seeded backend, and ``generate_rows`` sends the
    seeds it is given."""
    from gymbridge.generation.types import row_seed

    engine = FakeEngine()
    gen = make_gen(engine)
    rows = [GenerationInput(prompt_token_ids=[1, 2])] * 4
    await gen.generate(rows, SamplingConfig(seed=5))
    sent = [params.seed for _, params, _ in engine.requests]
    assert sent == [5, row_seed(5, 1), row_seed(5, 2), row_seed(5, 3)] and len(set(sent)) == 4
    engine.requests.clear()
    await gen.generate_rows(rows[:3], SamplingConfig(seed=99), [11, None, 13])
    assert [params.seed for _, params, _ in engine.requests] == [11, None, 13]
