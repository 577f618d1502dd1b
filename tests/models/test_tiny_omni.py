"""The tiny offline Qwen2.5-Omni thinker: special ids agree, one forward takes image, video and audio."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from gymbridge.models.tiny_omni import TinyOmni, build_tiny_omni
from gymbridge.models.tiny_vlm import AUDIO_PAD, IMAGE_PAD, SPECIAL_TOKENS, VIDEO_PAD


def test_config_ids_equal_the_tokenizers_and_the_vlm_ids_are_unchanged(tiny_omni: TinyOmni) -> None:
    cfg, tok = tiny_omni.model.config, tiny_omni.tokenizer
    assert cfg.image_token_id == tok.convert_tokens_to_ids(IMAGE_PAD) == 5
    assert cfg.video_token_id == tok.convert_tokens_to_ids(VIDEO_PAD) == 6
    assert cfg.audio_token_id == tok.convert_tokens_to_ids(AUDIO_PAD)
    assert cfg.audio_start_token_id == tok.convert_tokens_to_ids("<|audio_start|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    for i, name in enumerate(SPECIAL_TOKENS):  # the omni tokenizer extends the VLM's, same ids
        assert tok.convert_tokens_to_ids(name) == i
    assert build_tiny_omni(0) is tiny_omni  # cached per seed


def test_one_forward_takes_an_image_a_video_and_an_audio_clip(tiny_omni: TinyOmni) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "video"},
                {"type": "audio"},
                {"type": "text", "text": "hi"},
            ],
        }
    ]
    text = tiny_omni.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image = Image.new("RGB", (56, 56), (10, 200, 30))
    video = np.zeros((4, 64, 64, 3), dtype=np.uint8)
    audio = (np.zeros(16000, dtype=np.float32), 16000)
    enc = tiny_omni.processor(text=[text], images=[image], videos=[video], audio=[audio])
    ids = enc["input_ids"][0].tolist()
    assert ids.count(tiny_omni.image_token_id) == 4  # 56x56 -> 4x4 patches -> 4 merged tokens
    assert ids.count(tiny_omni.video_token_id) == 2 * 4  # 4 frames -> 2 temporal patches
    assert ids.count(tiny_omni.audio_token_id) == 25  # 1 s -> 100 frames -> 25 tokens
    kwargs = {k: v for k, v in enc.items() if k != "mm_token_type_ids"}
    with torch.no_grad():
        logits = tiny_omni.model(**kwargs).logits
    assert logits.shape == (1, len(ids), 512) and bool(torch.isfinite(logits).all())


def test_placeholder_count_mismatch_is_a_value_error(tiny_omni: TinyOmni) -> None:
    with pytest.raises(ValueError, match="audio"):
        tiny_omni.processor(text=["no placeholder"], audio=[(np.zeros(1600, dtype=np.float32), 16000)])


def test_regression_generator_never_samples_audio_boundary_tokens(tiny_omni: TinyOmni) -> None:
    """A sampled ``<|audio_start|>`` crashed the trainer's forward in Qwen2.5-Omni's M-RoPE index
    (``audio_seqlens`` is None without audio): the generator and the trainer mask it like a placeholder."""
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.generation.types import media_special_token_ids

    tok = tiny_omni.tokenizer
    boundaries = {tok.convert_tokens_to_ids(t) for t in ("<|audio_start|>", "<|audio_end|>")}
    want = set(tiny_omni.placeholder_token_ids) | boundaries
    want |= {tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>")}
    assert set(HFGenerator(tiny_omni.model, tiny_omni.processor).suppressed_token_ids) == want
    assert set(media_special_token_ids(tiny_omni.model.config)) == want  # the trainer's default mask
