"""HFGenerator on the tiny Qwen2-VL: logprobs under the sampling distribution, batching, seeds, refusals."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from gen_helpers import png_data_url, reference_logprobs

from gymbridge.errors import ProtocolError
from gymbridge.generation.batching import BatchingGenerator
from gymbridge.generation.chat import chat_to_messages
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.outputs import generation_input_from_prompt
from gymbridge.generation.types import ContextLengthError, Generation, SamplingConfig
from gymbridge.trajectory.types import GenerationInput


def make_input(gen: HFGenerator, text: str, colors: list[tuple[int, int, int]] = ()) -> GenerationInput:  # type: ignore[assignment]
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": png_data_url(c, (40 + 8 * i, 36))}}
        for i, c in enumerate(colors)
    ]
    parts.append({"type": "text", "text": text})
    rendered = gen.codec.render(chat_to_messages([{"role": "user", "content": parts}]))
    return generation_input_from_prompt(rendered.prompt_token_ids, rendered.media)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.0, max_tokens=12, seed=1),
        SamplingConfig(temperature=0.7, top_p=0.8, max_tokens=12, seed=2),
        SamplingConfig(temperature=0.0, max_tokens=12),
    ],
    ids=["t1", "t0.7-p0.8", "greedy"],
)
async def test_batched_logprobs_match_a_teacher_forced_forward(
    tiny_gen: HFGenerator, tiny: Any, sampling: SamplingConfig
) -> None:
    inputs = [
        make_input(tiny_gen, "What color?", [(255, 0, 0)]),
        make_input(tiny_gen, "Two images, and a longer question here.", [(0, 255, 0), (0, 0, 255)]),
        make_input(tiny_gen, "no image"),
    ]
    gens = await tiny_gen.generate(inputs, sampling)
    for inp, gen in zip(inputs, gens, strict=True):
        assert len(gen.token_ids) == len(gen.logprobs) > 0
        full = inp.prompt_token_ids + gen.token_ids
        ref = reference_logprobs(tiny, full, inp.multi_modal_data.get("image", []), sampling)
        diff = max(abs(a - b) for a, b in zip(gen.logprobs, ref[len(inp.prompt_token_ids) :], strict=True))
        assert diff < 1e-5, diff
        assert gen.prompt_token_ids == inp.prompt_token_ids


async def test_finish_reason_and_stop_tokens(tiny_gen: HFGenerator) -> None:
    inp = make_input(tiny_gen, "hello")
    first = (await tiny_gen.generate([inp], SamplingConfig(max_tokens=5, seed=0)))[0]
    assert first.finish_reason == "length" and len(first.token_ids) == 5
    # make the latest sampled token not sampled before it a stop token: generation must stop
    # there, keeping it (the first token always qualifies, so the stop path always runs)
    at = max(i for i, t in enumerate(first.token_ids[:4]) if t not in first.token_ids[:i])
    stop = first.token_ids[at]
    again = (await tiny_gen.generate([inp], SamplingConfig(max_tokens=5, seed=0, stop_token_ids=(stop,))))[0]
    assert again.token_ids == first.token_ids[: at + 1] and again.finish_reason == "stop"


async def test_seed_reproduces_and_leaves_the_global_rng_alone(tiny_gen: HFGenerator) -> None:
    import torch

    inp = make_input(tiny_gen, "seeded")
    state = torch.random.get_rng_state()
    a = await tiny_gen.generate([inp], SamplingConfig(max_tokens=8, seed=11))
    b = await tiny_gen.generate([inp], SamplingConfig(max_tokens=8, seed=11))
    c = await tiny_gen.generate([inp], SamplingConfig(max_tokens=8, seed=12))
    assert a == b and a != c
    assert torch.equal(state, torch.random.get_rng_state())


async def test_placeholders_out_of_step_with_media_are_refused(tiny_gen: HFGenerator) -> None:
    one = make_input(tiny_gen, "q", [(255, 0, 0)])
    two = make_input(tiny_gen, "q", [(255, 0, 0), (0, 0, 255)])
    stale = GenerationInput(prompt_token_ids=one.prompt_token_ids, multi_modal_data=two.multi_modal_data)
    with pytest.raises(ProtocolError, match="out of step"):
        await tiny_gen.generate([stale], SamplingConfig(max_tokens=2))
    missing = GenerationInput(prompt_token_ids=one.prompt_token_ids)
    with pytest.raises(ProtocolError, match="no images"):
        await tiny_gen.generate([missing], SamplingConfig(max_tokens=2))


async def test_context_limit(tiny_gen: HFGenerator) -> None:
    big = GenerationInput(prompt_token_ids=[20] * tiny_gen.max_model_len)
    with pytest.raises(ContextLengthError):
        await tiny_gen.generate([big], SamplingConfig(max_tokens=2))


async def test_score_matches_generate(tiny_gen: HFGenerator) -> None:
    inp = make_input(tiny_gen, "score me", [(10, 20, 30)])
    s = SamplingConfig(temperature=0.9, top_p=0.95, max_tokens=6, seed=4)
    gen = (await tiny_gen.generate([inp], s))[0]
    scored = (await tiny_gen.score([inp], [gen.token_ids], s))[0]
    assert max(abs(a - b) for a, b in zip(gen.logprobs, scored.logprobs, strict=True)) < 1e-5
    assert scored.finish_reason == gen.finish_reason


class _Recorder:
    def __init__(self, fail_on: int | None = None) -> None:
        self.calls: list[tuple[int, SamplingConfig]] = []
        self.fail_on = fail_on

    async def generate(self, inputs: Any, sampling: SamplingConfig) -> list[Generation]:
        self.calls.append((len(inputs), sampling))
        await asyncio.sleep(0)
        out = []
        for inp in inputs:
            if inp.prompt_token_ids[0] == self.fail_on:
                raise ValueError("bad row")
            out.append(Generation([inp.prompt_token_ids[0]], [-1.0], "stop", list(inp.prompt_token_ids)))
        return out


async def test_batching_groups_concurrent_requests_by_sampling() -> None:
    inner = _Recorder()
    batched = BatchingGenerator(inner, max_batch_size=4, window_s=0.05)
    s1, s2 = SamplingConfig(temperature=0.5), SamplingConfig(temperature=0.7)
    reqs = [batched.generate([GenerationInput([i])], s1 if i % 2 else s2) for i in range(6)]
    results = await asyncio.gather(*reqs)
    assert [r[0].token_ids for r in results] == [[i] for i in range(6)]
    assert sum(n for n, _ in inner.calls) == 6 and len(inner.calls) < 6
    assert all(n <= 4 for n, _ in inner.calls)
    await batched.aclose()


async def test_regression_seeded_calls_are_never_merged_with_other_calls() -> None:
    """Concurrent requests with the same seed were merged into one batch, so none got the answer
    it would get alone (0 of 4)."""
    inner = _Recorder()
    batched = BatchingGenerator(inner, max_batch_size=8, window_s=0.05)
    seeded = SamplingConfig(seed=7)
    reqs = [batched.generate([GenerationInput([i])], seeded) for i in range(4)]
    reqs.append(batched.generate([GenerationInput([8]), GenerationInput([9])], seeded))  # one call, 2 rows
    await asyncio.gather(*reqs)
    assert sorted(n for n, _ in inner.calls) == [1, 1, 1, 1, 2]  # each call as it was asked
    await batched.aclose()


async def test_one_bad_row_does_not_fail_its_batch() -> None:
    batched = BatchingGenerator(_Recorder(fail_on=3), window_s=0.05)
    reqs = [batched.generate([GenerationInput([i])], SamplingConfig()) for i in range(5)]
    results = await asyncio.gather(*reqs, return_exceptions=True)
    assert isinstance(results[3], ValueError)
    assert [r[0].token_ids for i, r in enumerate(results) if i != 3] == [[0], [1], [2], [4]]  # type: ignore[index]
    await batched.aclose()


async def test_from_pretrained_loads_a_saved_vlm(tiny_gen: HFGenerator, tiny: Any, tmp_path: Any) -> None:
    """A model saved to a local directory (no hub) generates like the in-memory one, images included."""
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    tiny.processor.image_processor.save_pretrained(tmp_path)
    loaded = HFGenerator.from_pretrained(str(tmp_path), device="cpu")
    inp = make_input(tiny_gen, "same?", [(1, 2, 3)])
    s = SamplingConfig(max_tokens=4, seed=9)
    assert await loaded.generate([inp], s) == await tiny_gen.generate([inp], s)
    assert make_input(loaded, "same?", [(1, 2, 3)]).prompt_token_ids == inp.prompt_token_ids


def test_regression_pickle_only_weights_are_refused_never_unpickled(
    tiny: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``from_pretrained`` ran without ``use_safetensors=True``: a directory holding only
    ``pytorch_model.bin`` was unpickled (code from the file could run), against docs/security.md."""
    import torch

    from gymbridge.errors import ConfigError
    from gymbridge.run.model import load_pretrained

    tiny.model.config.save_pretrained(tmp_path)
    torch.save(tiny.model.state_dict(), tmp_path / "pytorch_model.bin")  # the pickle a hub repo may hold
    tiny.tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "pytorch_model.bin").is_file() and not list(tmp_path.glob("*.safetensors"))
    unpickled: list[object] = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: unpickled.append(a))
    with pytest.raises(ConfigError, match=r"pickle files only \(pytorch_model.bin\)") as err:
        HFGenerator.from_pretrained(str(tmp_path), device="cpu")
    assert err.value.source == str(tmp_path)
    with pytest.raises(ConfigError, match="gymbridge never unpickles"):
        load_pretrained(str(tmp_path))  # the run's loader (``model.name: <dir>``) too
    assert unpickled == []


async def test_regression_from_pretrained_finds_omni_image_placeholder(
    tiny_gen: HFGenerator, tiny: Any, tmp_path: Any
) -> None:
    """Bug: the fallback processor looked for ``<|image_pad|>``, which Qwen2.5-Omni spells ``<|IMAGE|>``.

    A saved model whose tokenizer spells the image placeholder ``<|IMAGE|>`` (at the id its config
    names, as Qwen2.5-Omni's does) loaded as text-only: every image prompt was refused.
    """
    from gymbridge.models.tiny_vlm import IMAGE_PAD, SPECIAL_TOKENS, build_tiny_tokenizer

    omni_spelling = build_tiny_tokenizer([("<|IMAGE|>" if t == IMAGE_PAD else t) for t in SPECIAL_TOKENS])
    omni_spelling.chat_template = tiny.tokenizer.chat_template.replace(IMAGE_PAD, "<|IMAGE|>")
    assert omni_spelling.convert_tokens_to_ids("<|IMAGE|>") == tiny.image_token_id
    assert IMAGE_PAD not in omni_spelling.get_vocab()
    tiny.model.save_pretrained(tmp_path)
    omni_spelling.save_pretrained(tmp_path)
    tiny.processor.image_processor.save_pretrained(tmp_path)
    loaded = HFGenerator.from_pretrained(str(tmp_path), device="cpu")
    assert loaded.processor.image_token == "<|IMAGE|>"
    inp = make_input(loaded, "same?", [(1, 2, 3)])
    assert inp.prompt_token_ids == make_input(tiny_gen, "same?", [(1, 2, 3)]).prompt_token_ids
    s = SamplingConfig(max_tokens=4, seed=9)
    (got,), (want,) = await loaded.generate([inp], s), await tiny_gen.generate([inp], s)
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


async def test_regression_generator_never_samples_media_placeholders(
    tiny_gen: HFGenerator, tiny: Any
) -> None:
    """Bug: the random tiny model sampled <|image_pad|> / <|video_pad|> / vision boundaries ~1 rollout in 10.

    A sampled placeholder needs an image feature nobody provides: the trainer's VLM forward
    crashed ("Image features and image tokens do not match") and the next turn broke too.
    """
    import torch

    banned = {tiny.image_token_id, tiny.video_token_id, tiny.vision_start_token_id, tiny.vision_end_token_id}
    assert banned <= set(tiny_gen.suppressed_token_ids)
    inputs = [make_input(tiny_gen, f"Describe picture {i}.", [(40 * i % 256, 90, 200)]) for i in range(16)]
    sampling = SamplingConfig(temperature=3.0, max_tokens=48, seed=7)
    sampled: list[int] = []
    for gen in await tiny_gen.generate(inputs * 4, sampling):
        sampled.extend(gen.token_ids)
        assert all(lp > float("-inf") for lp in gen.logprobs)
    assert len(sampled) > 2000
    assert not banned.intersection(sampled), sorted(banned.intersection(sampled))
    # control: the same model without the mask does sample them at this temperature
    ids = torch.tensor([inputs[0].prompt_token_ids], dtype=torch.long)
    probs = torch.softmax(tiny.model(input_ids=ids).logits[0, -1].detach() / 3.0, dim=-1)
    assert float(probs[sorted(banned)].sum()) * len(sampled) > 5  # expected hits without the mask


async def test_masked_logprobs_need_the_same_mask_to_teacher_force(tiny_gen: HFGenerator, tiny: Any) -> None:
    """The reported logprobs are under the masked distribution: matching them needs the same mask.

    Without it the random tiny model's logprobs differ by the mass it puts on media ids
    (~1e-2), far above the 1e-5 exactness bar; the trainer therefore applies the mask too.
    """
    inp = make_input(tiny_gen, "What color?", [(255, 0, 0)])
    sampling = SamplingConfig(temperature=1.0, max_tokens=16, seed=3)
    gen = (await tiny_gen.generate([inp], sampling))[0]
    full = inp.prompt_token_ids + gen.token_ids
    images = inp.multi_modal_data.get("image", [])
    n = len(inp.prompt_token_ids)
    masked = reference_logprobs(tiny, full, images, sampling)[n:]
    unmasked = reference_logprobs(tiny, full, images, sampling, mask_media_tokens=False)[n:]
    assert max(abs(a - b) for a, b in zip(gen.logprobs, masked, strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(gen.logprobs, unmasked, strict=True)) > 1e-4
    scored = tiny_gen.score_sync(inp, gen.token_ids, sampling)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, scored, strict=True)) < 1e-5


async def test_regression_a_seeded_row_gets_its_answer_alone_or_batched(tiny_gen: HFGenerator) -> None:
    """Seeded rows were generated one per call (a batch shared one RNG, so a row's sample depended on
    its batch-mates): the default smoke's 16 reproducible rollouts a step cost 16 forward passes.
    Each row now samples from its own stream: batched, it gets the tokens it gets alone."""
    inputs = [make_input(tiny_gen, f"What colour? {i}", [(30 * i % 256, 90, 200)]) for i in range(6)]
    sampling = SamplingConfig(temperature=1.0, max_tokens=6)
    seeds = [101, 7, 7, 3_000_000_000_123, 0, 42]  # a seed may repeat across rows
    batched = await tiny_gen.generate_rows(inputs, sampling, seeds)
    for inp, seed, got in zip(inputs, seeds, batched, strict=True):
        (alone,) = await tiny_gen.generate([inp], SamplingConfig(temperature=1.0, max_tokens=6, seed=seed))
        assert got.token_ids == alone.token_ids
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # and the rows of one seeded call never replay each other's stream
    same = [inputs[0]] * 8
    outs = await tiny_gen.generate(same, SamplingConfig(temperature=1.0, max_tokens=6, seed=5))
    assert len({tuple(g.token_ids) for g in outs}) > 1


async def test_row_sampler_draws_from_the_processed_distribution(tiny_gen: HFGenerator, tiny: Any) -> None:
    """The Gumbel-max draw is a sample of softmax(logits / T) with media ids masked: 4000 seeded
    one-token rows of one prompt match the model's probabilities (each of the 6 likeliest tokens
    within 4.5 standard errors; seeded, so the check is deterministic)."""
    import torch

    inp = make_input(tiny_gen, "Say something.")
    n = 4000
    sampling = SamplingConfig(temperature=1.3, max_tokens=1)
    gens = await tiny_gen.generate_rows([inp] * n, sampling, list(range(n)))
    counts: dict[int, int] = {}
    for g in gens:
        counts[g.token_ids[0]] = counts.get(g.token_ids[0], 0) + 1
    ids = torch.tensor([inp.prompt_token_ids], dtype=torch.long)
    with torch.no_grad():
        logits = tiny.model(input_ids=ids).logits[0, -1]
    probs = torch.exp(tiny_gen.processed_logprobs(logits[None], sampling)[0])
    assert float(probs[list(tiny_gen.suppressed_token_ids)].sum()) == 0.0
    for token in torch.argsort(probs, descending=True)[:6].tolist():
        p = float(probs[token])
        se = (p * (1 - p) / n) ** 0.5
        assert abs(counts.get(token, 0) / n - p) < 4.5 * se, (token, counts.get(token, 0) / n, p)
    lp = {g.token_ids[0]: g.logprobs[0] for g in gens}
    assert all(abs(v - float(torch.log(probs[t]))) < 1e-5 for t, v in lp.items())


class _RowRecorder(_Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[int | None]] = []

    async def generate_rows(self, inputs: Any, sampling: SamplingConfig, seeds: Any) -> list[Generation]:
        self.rows.append(list(seeds))
        return await self.generate(inputs, sampling)


async def test_seeded_calls_share_a_batch_in_a_row_seeded_backend() -> None:
    """Into a backend with ``generate_rows`` seeded calls merge, each row with its own row seed."""
    from gymbridge.generation.types import row_seed

    inner = _RowRecorder()
    batched = BatchingGenerator(inner, max_batch_size=8, window_s=0.05)
    reqs = [batched.generate([GenerationInput([i])], SamplingConfig(seed=i)) for i in range(3)]
    reqs.append(batched.generate([GenerationInput([8]), GenerationInput([9])], SamplingConfig(seed=7)))
    reqs.append(batched.generate([GenerationInput([10])], SamplingConfig()))
    results = await asyncio.gather(*reqs)
    assert [[g.token_ids[0] for g in r] for r in results] == [[0], [1], [2], [8, 9], [10]]
    assert [n for n, _ in inner.calls] == [6] and all(s.seed is None for _, s in inner.calls)
    assert inner.rows == [[0, 1, 2, 7, row_seed(7, 1), None]]
    await batched.aclose()


async def test_prompt_seeded_generator_batches_a_row_seeded_backend(tiny_gen: HFGenerator) -> None:
    """``PromptSeededGenerator`` (the reproducible Gym path) hands a row-seeded backend the whole call:
    one ``generate_rows`` call, the same samples as one row per call."""
    from gymbridge.generation.seeding import PromptSeededGenerator

    inputs = [make_input(tiny_gen, f"q{i % 2}", [(200 * (i % 2), 40, 90)]) for i in range(8)]
    sampling = SamplingConfig(temperature=1.0, max_tokens=5)
    calls: list[int] = []

    class _OneByOne:  # the same backend without generate_rows
        policy_version = 0

        async def generate(self, rows: Any, s: SamplingConfig) -> list[Generation]:
            calls.append(len(rows))
            return await tiny_gen.generate(rows, s)

    together = await PromptSeededGenerator(tiny_gen, 3).generate(inputs, sampling)
    apart = await PromptSeededGenerator(_OneByOne(), 3).generate(inputs, sampling)
    assert calls == [1] * 8
    assert [g.token_ids for g in together] == [g.token_ids for g in apart]


async def test_regression_a_checkpoints_generation_config_cannot_narrow_the_sampler(
    tiny_gen: HFGenerator,
) -> None:
    """A real checkpoint ships its own generation_config (Qwen2-VL-Instruct: ``do_sample`` with
    ``top_k=1``, ``temperature=0.01``) and transformers fills unset settings from it: 4.x fills
    settings left at their defaults too and puts its warpers in front of ours (every sample the
    argmax), 5.x appends them after the row sampler. Either way the rows sample the requested
    distribution and report its logprobs."""
    model = tiny_gen.model
    saved = model.generation_config
    model.generation_config = type(saved)(do_sample=True, top_k=1, top_p=0.001, temperature=0.01)
    try:
        inp = make_input(tiny_gen, "Say something.")
        sampling = SamplingConfig(temperature=1.0, max_tokens=3)
        gens = await tiny_gen.generate_rows([inp] * 16, sampling, list(range(16)))
        assert len({tuple(g.token_ids) for g in gens}) > 4
        for g in gens[:3]:
            scored = tiny_gen.score_sync(inp, g.token_ids, sampling)
            assert max(abs(a - b) for a, b in zip(g.logprobs, scored, strict=True)) < 1e-5
    finally:
        model.generation_config = saved
