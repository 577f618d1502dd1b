"""Regression tests for defects found in review of the generation package (one test per bug)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from test_gen_types_vllm import FakeEngine, make_gen
from test_gen_types_vllm import fake_vllm as fake_vllm  # the stand-in vllm module fixture

from gymbridge.errors import ProtocolError
from gymbridge.generation.batching import BatchingGenerator
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.server import ModelServer, ModelServerConfig
from gymbridge.generation.types import Generation, SamplingConfig
from gymbridge.trajectory.types import GenerationInput

USER = [{"role": "user", "content": "x"}]


@pytest.fixture
async def client(tiny_gen: HFGenerator) -> AsyncIterator[httpx.AsyncClient]:
    config = ModelServerConfig(model_name="tiny", max_model_len=600, default_max_tokens=4)
    srv = ModelServer(tiny_gen, config=config)
    await srv.start()
    async with httpx.AsyncClient(base_url=str(srv.url), timeout=60) as c:
        yield c
    await srv.stop()


@pytest.mark.parametrize(
    ("path", "payload", "needle"),
    [
        ("/v1/chat/completions", {"messages": USER, "tools": 5}, "tools"),
        ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": 5}, "chat_template_kwargs"),
        (
            "/v1/chat/completions",
            {"messages": [*USER, {"role": "assistant", "content": "y", "tool_calls": 5}]},
            "tool_calls",
        ),
        ("/v1/responses", {"input": "hi", "tools": 5}, "tools"),
        ("/v1/responses", {"input": [{"type": "reasoning", "summary": 5}]}, "summary"),
        ("/v1/responses", {"input": "hi", "instructions": 5}, "instructions"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": USER, "stop_token_ids": [True]}, "stop_token_ids"),
    ],
)
async def test_regression_malformed_fields_are_400_not_500(
    client: httpx.AsyncClient, path: str, payload: Any, needle: str
) -> None:
    reply = await client.post(path, json=payload)
    assert reply.status_code == 400, reply.text
    assert needle in reply.json()["message"]


@pytest.mark.parametrize("bad_id", [-1, 10**9])
async def test_regression_out_of_vocab_replayed_tokens_are_400_not_500(
    client: httpx.AsyncClient, bad_id: int
) -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": "y", "prompt_token_ids": [1], "generation_token_ids": [bad_id]},
        {"role": "user", "content": "z"},
    ]
    reply = await client.post("/v1/chat/completions", json={"messages": messages})
    assert reply.status_code == 400, reply.text
    assert str(bad_id) in reply.json()["message"]


async def test_regression_hf_generator_refuses_out_of_vocab_prompt(tiny_gen: HFGenerator) -> None:
    vocab = tiny_gen.model.get_input_embeddings().num_embeddings
    bad = GenerationInput(prompt_token_ids=[1, vocab], multi_modal_data={})
    with pytest.raises(ProtocolError, match=str(vocab)):
        await tiny_gen.generate([bad], SamplingConfig(max_tokens=2))
    with pytest.raises(ProtocolError, match="out of range"):
        await tiny_gen.score([bad], [[1]], SamplingConfig(max_tokens=2))


class _Blocking:
    """An inner generator that never finishes until released."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def generate(self, inputs: Sequence[GenerationInput], sampling: SamplingConfig) -> list[Generation]:
        self.started.set()
        await self.release.wait()
        return [Generation([1], [-0.5], "stop") for _ in inputs]


async def test_regression_batching_aclose_does_not_strand_waiters() -> None:
    inner = _Blocking()
    batching = BatchingGenerator(inner, window_s=0.0)
    inp = GenerationInput(prompt_token_ids=[1], multi_modal_data={})
    in_flight = asyncio.ensure_future(batching.generate([inp], SamplingConfig()))
    await asyncio.wait_for(inner.started.wait(), 5)
    queued = asyncio.ensure_future(batching.generate([inp], SamplingConfig()))
    await asyncio.sleep(0.01)
    await batching.aclose()
    done, pending = await asyncio.wait([in_flight, queued], timeout=2)
    assert not pending, "callers waiting on a closed BatchingGenerator hang forever"
    for task in done:
        assert task.cancelled()


@pytest.mark.usefixtures("fake_vllm")
async def test_regression_vllm_server_requests_not_serialised_behind_each_other(
    tiny_gen: HFGenerator,
) -> None:
    """vLLM batches continuously: a short request must not wait for an earlier long one to finish."""
    second_done = asyncio.Event()
    base = FakeEngine()

    class Engine(FakeEngine):
        async def generate(self, prompt: Any, params: Any, request_id: str) -> Any:
            first = request_id.endswith("-0")
            if first:  # the long request: finishes only after the later one was answered
                await asyncio.wait_for(second_done.wait(), 5)
            async for out in base.generate(prompt, params, request_id):
                yield out
            if not first:
                second_done.set()

    gen = make_gen(Engine())
    server = ModelServer(gen, codec=tiny_gen.codec, config=ModelServerConfig(max_model_len=128))
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=str(server.url), timeout=30) as c:
            body = {"messages": USER, "max_tokens": 3, "logprobs": True}
            first = asyncio.ensure_future(c.post("/v1/chat/completions", json=body))
            await asyncio.sleep(0.2)
            second = await c.post("/v1/chat/completions", json=body)
            assert second.status_code == 200
            assert (await first).status_code == 200
    finally:
        await server.stop()


async def test_regression_long_row_does_not_shorten_its_batch_neighbours() -> None:
    """One prompt near the context limit lowered ``max_tokens`` for every row of the call."""
    from test_gen_hf import make_input

    gen = HFGenerator.tiny(0, max_model_len=256)
    short = make_input(gen, "hello")
    long = GenerationInput(prompt_token_ids=[20] * (256 - 3))
    greedy = SamplingConfig(temperature=0.0, max_tokens=8)
    alone = (await gen.generate([short], greedy))[0]
    assert len(alone.token_ids) == 8  # this random model does not stop within 8 greedy tokens
    together = await gen.generate([short, long], greedy)
    assert together[0].token_ids == alone.token_ids and together[0].finish_reason == alone.finish_reason
    assert len(together[1].token_ids) == 3 and together[1].finish_reason == "length"


async def test_regression_vllm_long_row_does_not_shorten_its_batch_neighbours(fake_vllm: Any) -> None:
    engine = FakeEngine()
    gen = make_gen(engine)  # max_model_len 128
    short = GenerationInput(prompt_token_ids=[1, 2, 3])
    long = GenerationInput(prompt_token_ids=[1] * 126)
    await gen.generate([short, long], SamplingConfig(max_tokens=16))
    assert [params.max_tokens for _, params, _ in engine.requests] == [16, 2]


async def test_regression_model_server_does_not_rewrite_the_generators_codec() -> None:
    """ModelServer set ``reasoning_parser`` on the generator's own codec, changing native rollouts too."""
    gen = HFGenerator.tiny(0)
    think = gen.tokenizer("<think>plan</think>answer", add_special_tokens=False)["input_ids"]
    assert gen.codec.parse(think).reasoning == ["plan"]
    server = ModelServer(gen, config=ModelServerConfig(reasoning_parser=False))
    assert server.codec.parse(think).reasoning == [] and "<think>" in server.codec.parse(think).content
    assert gen.codec.reasoning_parser and gen.codec.parse(think).reasoning == ["plan"]
    # without a config, the server keeps the generator's own choice
    plain = HFGenerator.tiny(0, reasoning_parser=False)
    assert ModelServer(plain).codec.parse(think).reasoning == []


async def test_regression_seeded_chunks_do_not_repeat_each_other() -> None:
    """Each chunk of ``max_batch_size`` rows was re-seeded with the same seed: a GRPO group of
    identical prompts larger than one chunk got exact duplicate samples (rows 0 and 2 here)."""
    from test_gen_hf import make_input

    gen = HFGenerator.tiny(0, max_batch_size=2)
    inp = make_input(gen, "same prompt")
    sampling = SamplingConfig(temperature=1.0, max_tokens=6, seed=3)
    gens = await gen.generate([inp] * 4, sampling)
    assert gens[0].token_ids != gens[1].token_ids  # within a chunk the RNG advances
    assert gens[0].token_ids != gens[2].token_ids and gens[1].token_ids != gens[3].token_ids
    again = await gen.generate([inp] * 4, sampling)
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]  # still reproducible


async def test_regression_scoring_an_empty_prompt_is_a_protocol_error(tiny_gen: HFGenerator) -> None:
    with pytest.raises(ProtocolError, match="empty prompt"):
        await tiny_gen.score([GenerationInput(prompt_token_ids=[])], [[1, 2]], SamplingConfig())


async def test_regression_unseeded_calls_repeat_the_same_sample(tiny_gen: HFGenerator) -> None:
    """``fork_rng`` restored the global RNG after every call, so every unseeded call (the model
    server's default: genuine vllm_model sends no seed) drew the very same tokens: a GRPO group
    served one request at a time got G identical rollouts."""
    from test_gen_hf import make_input

    inp = make_input(tiny_gen, "same prompt")
    unseeded = SamplingConfig(temperature=1.0, max_tokens=6)
    samples = [(await tiny_gen.generate([inp], unseeded))[0].token_ids for _ in range(3)]
    assert len({tuple(s) for s in samples}) == 3, samples
    chunked = await HFGenerator.tiny(0, max_batch_size=1).generate([inp] * 3, unseeded)
    assert len({tuple(g.token_ids) for g in chunked}) == 3


def test_regression_cli_tiny_with_vllm_backend_is_refused_not_ignored(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--tiny --backend vllm`` silently served the transformers model."""
    from gymbridge.generation.cli import main

    assert main(["serve", "--tiny", "--backend", "vllm", "--port", "0"]) == 2
    assert "--backend hf" in capsys.readouterr().err


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 9e-6])
async def test_regression_hf_generator_treats_temperatures_below_float32_range_as_greedy(
    tiny_gen: HFGenerator, temperature: float
) -> None:
    """``SamplingConfig(temperature=1e-40)`` reached HF's temperature warper: logits / 1e-40 are inf,
    so sampling raised "probability tensor contains inf/nan" and teacher-forced logprobs were NaN."""
    import torch

    from gymbridge.generation.types import GREEDY_BELOW_TEMPERATURE

    tiny = SamplingConfig(temperature=temperature, max_tokens=4)
    assert tiny.temperature == 0.0 and tiny == SamplingConfig(temperature=0.0, max_tokens=4)
    assert SamplingConfig(temperature=GREEDY_BELOW_TEMPERATURE).temperature == GREEDY_BELOW_TEMPERATURE
    inp = GenerationInput(prompt_token_ids=[100, 101, 102, 103])
    greedy = (await tiny_gen.generate([inp], SamplingConfig(temperature=0.0, max_tokens=4)))[0]
    got = (await tiny_gen.generate([inp], tiny))[0]
    assert (got.token_ids, got.logprobs) == (greedy.token_ids, greedy.logprobs)
    logits = torch.randn(3, 64)
    scored = tiny_gen.processed_logprobs(logits, tiny)  # -inf only where the media ids are masked
    assert not bool(torch.isnan(scored).any()) and bool(torch.isfinite(scored).any(dim=-1).all())
    assert torch.equal(scored, tiny_gen.processed_logprobs(logits, SamplingConfig(temperature=0.0)))
