"""Each family's own rules, where getting them wrong would go unnoticed by a Qwen-only check.

* the family of a model, a config and a processor agree; an unknown model gets the generic rules;
* expanding placeholders by count (the model server's cache shortcut) gives the processor's tokens;
* Gemma 3: the image's tokens attend to each other both ways, and the trainer reproduces it only
  with the family's token types; its packed masks (per layer type, windowed, image blocks) are
  needed: the plain block-diagonal causal mask gives other logprobs;
* Gemma 3's chat turns end at ``<end_of_turn>``; a Hermes tool call inside a Gemma turn parses;
* InternVL: a wide image takes 3 tiles (12 placeholders), ``num_patches`` never reaches the model;
* a saved Qwen2.5-VL loads with its processor class (without the torchvision video processor).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from family_helpers import FAMILIES, GROUP_SIZE, TEMPERATURE, png, rollouts

from gymbridge.families import GENERIC, Gemma3, InternVL, QwenOmni, QwenVL, family_of
from gymbridge.generation.chat import ChatCodec, ChatMessage
from gymbridge.generation.hf import HFGenerator
from gymbridge.media import MediaItem
from gymbridge.models.tiny_families import tiny_model
from gymbridge.tensors import MediaProcessor, TrainBatch
from gymbridge.trainer import packing
from gymbridge.trainer.grpo import token_logprobs

EXPECTED = {
    "qwen2_vl": QwenVL,
    "qwen2_5_vl": QwenVL,
    "qwen3_vl": QwenVL,
    "gemma3": Gemma3,
    "internvl": InternVL,
    "qwen2_5_omni": QwenOmni,
}


@pytest.mark.parametrize("family", list(EXPECTED))
def test_model_config_and_processor_name_one_family(family: str) -> None:
    tiny = tiny_model(family)
    want = EXPECTED[family]
    assert type(family_of(tiny.model)) is want and type(family_of(tiny.model.config)) is want
    # the omni thinker's processor is the Qwen-style one: its processor rules are Qwen-VL's
    assert isinstance(family_of(tiny.processor), QwenVL if want is QwenOmni else want)
    assert (
        family_of(tiny.model).placeholder_ids(tiny.model.config)["image"]
        == tiny.placeholder_token_ids["image"]
    )
    assert family_of(object()) is GENERIC


@pytest.mark.parametrize("family", FAMILIES)
def test_expanding_by_count_gives_the_processors_tokens(family: str) -> None:
    tiny = tiny_model(family)
    codec = ChatCodec(tiny.processor)
    items = [
        MediaItem.from_bytes(png((200, 10, 10), (56, 56)), "image", mime="image/png"),
        MediaItem.from_bytes(png((10, 10, 200), (112, 56)), "image", mime="image/png"),
    ]
    messages = [ChatMessage(role="user", parts=[items[0], "left", items[1], "right?"])]
    text = codec.template_text(messages)
    processor = MediaProcessor(tiny.processor)
    done = processor.process(items)
    by_count = codec.encode(text, items, placeholders=lambda m: done[m.key].num_placeholders)
    assert codec._expansion_ok == {"image": True}  # checked against the processor, and equal
    assert by_count == codec.encode(text, items)
    assert by_count.count(tiny.placeholder_token_ids["image"]) == sum(
        int(done[m.key].num_placeholders or 0) for m in items
    )


def _gemma_batch() -> tuple[Any, TrainBatch]:
    r = rollouts("gemma3", "tool_image")
    batch = TrainBatch.from_trajectories(
        r.trajectories, MediaProcessor(r.tiny.processor), group_size=GROUP_SIZE
    )
    return r.tiny.model, batch


def test_gemma3_images_attend_both_ways_and_the_trainer_reproduces_it_only_with_its_token_types(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, batch = _gemma_batch()
    mask = batch.loss_mask > 0
    with torch.no_grad():
        exact = token_logprobs(model, batch, temperature=TEMPERATURE)
    assert float((exact[mask] - batch.logprobs[mask]).abs().max()) < 1e-5
    # the same forward without token_type_ids (plain causal attention over the image): other numbers
    monkeypatch.setattr(Gemma3, "token_type_kwargs", lambda self, *a, **k: {})
    with torch.no_grad():
        causal = token_logprobs(model, batch, temperature=TEMPERATURE)
    assert float((causal[mask] - batch.logprobs[mask]).abs().max()) > 1e-3


def test_gemma3_packs_with_its_own_masks_and_the_plain_causal_one_would_differ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, batch = _gemma_batch()
    assert batch.seq_len > 2 * model.config.get_text_config().sliding_window  # the window matters here
    packing.check_packable(model)  # sliding-window layers pack: the family builds their masks
    mask = batch.loss_mask > 0
    with torch.no_grad():
        packed = token_logprobs(model, batch, temperature=TEMPERATURE, packed=True)
    assert float((packed[mask] - batch.logprobs[mask]).abs().max()) < 1e-5
    monkeypatch.setattr(Gemma3, "packed_attention_mask", lambda self, *a, **k: None)
    with torch.no_grad():
        plain = token_logprobs(model, batch, temperature=TEMPERATURE, packed=True)
    assert float((plain[mask] - batch.logprobs[mask]).abs().max()) > 1e-3


def test_gemma3_packing_is_refused_under_an_attention_that_takes_no_masks() -> None:
    from gymbridge.errors import ConfigError

    model = copy.deepcopy(tiny_model("gemma3").model)
    model.config.get_text_config()._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match=r"gemma3.*needs its own packed masks"):
        packing.check_packable(model)


def test_gemma3_turns_end_at_end_of_turn_and_a_tool_call_in_a_gemma_turn_parses() -> None:
    tiny = tiny_model("gemma3")
    codec = ChatCodec(tiny.processor)
    assert codec.end_of_turn == "<end_of_turn>" and codec.end_of_turn_id in codec.stop_token_ids
    text = codec.template_text(
        [ChatMessage(role="user", parts=["hi"])], [{"type": "function", "function": {"name": "look"}}]
    )
    assert text.startswith("<bos><start_of_turn>user\n# Tools") and text.endswith("<start_of_turn>model\n")
    ids = tiny.tokenizer(
        '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>', add_special_tokens=False
    )
    parsed = codec.parse([*ids["input_ids"], codec.end_of_turn_id])
    assert [c.name for c in parsed.tool_calls] == ["look"]


def test_internvl_tiles_a_wide_image_and_never_passes_num_patches() -> None:
    tiny = tiny_model("internvl")
    processor = MediaProcessor(tiny.processor)
    wide = MediaItem.from_bytes(png((1, 2, 3), (112, 56)), "image", mime="image/png")
    square = MediaItem.from_bytes(png((4, 5, 6), (56, 56)), "image", mime="image/png")
    done = processor.process([wide, square])
    assert done[wide.key].outputs["pixel_values"].shape[0] == 3  # two tiles and a thumbnail
    assert (done[wide.key].num_placeholders, done[square.key].num_placeholders) == (12, 4)
    assert set(done[wide.key].outputs) == {"pixel_values"}


def test_a_saved_qwen2_5_vl_loads_with_its_processor_class_and_generates_the_same(tmp_path: Path) -> None:
    import asyncio

    from gymbridge.generation.types import SamplingConfig
    from gymbridge.trajectory.types import GenerationInput

    tiny = tiny_model("qwen2_5_vl")
    tiny.model.save_pretrained(tmp_path)
    tiny.processor.save_pretrained(tmp_path)
    loaded = HFGenerator.from_pretrained(str(tmp_path), device="cpu")
    assert (
        type(loaded.processor).__name__ == "Qwen2_5_VLProcessor" and type(family_of(loaded.model)) is QwenVL
    )
    original = HFGenerator(tiny.model, tiny.processor)
    item = MediaItem.from_bytes(png((90, 20, 200), (84, 56)), "image", mime="image/png")
    prompts = []
    for gen in (original, loaded):
        rendered = gen.codec.render([ChatMessage(role="user", parts=[item, "colour?"])])
        prompts.append(rendered.prompt_token_ids)
    assert prompts[0] == prompts[1]
    inp = GenerationInput(
        prompt_token_ids=prompts[0], multi_modal_data={"image": [item.image()]}, media=[item]
    )
    sampling = SamplingConfig(max_tokens=4, temperature=0.0)
    a, b = (asyncio.run(g.generate([inp], sampling))[0] for g in (original, loaded))
    assert (a.token_ids, a.finish_reason, a.prompt_token_ids) == (
        b.token_ids,
        b.finish_reason,
        b.prompt_token_ids,
    )
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_regression_a_whole_omni_checkpoint_gets_the_thinkers_vllm_prompt() -> None:
    """Bug: a whole Qwen2.5-Omni checkpoint's config (``model_type: qwen2_5_omni``, as vLLM serves
    it) keeps its token ids on ``thinker_config``; the families looked at ``text_config`` only and
    knew ``qwen2_5_omni_thinker`` only, so it had no placeholder ids: its prompt reached vLLM
    expanded, and vLLM expanded it again."""
    import transformers

    from gymbridge.generation.vllm import collapse_placeholders, placeholder_token_ids

    tiny = tiny_model("qwen2_5_omni")
    whole = transformers.Qwen2_5OmniConfig(
        thinker_config=tiny.model.config.to_dict(), enable_audio_output=False
    )
    family = family_of(whole)
    assert isinstance(family, QwenOmni)
    assert placeholder_token_ids(whole) == family.placeholder_ids(whole) == tiny.placeholder_token_ids
    image = tiny.placeholder_token_ids["image"]
    prompt = [1, *([image] * 4), 2, *([image] * 4), 3]
    short = collapse_placeholders(
        prompt, {"image": 2}, placeholder_token_ids(whole), family=family, hf_config=whole
    )
    assert short == [1, image, 2, image, 3]
