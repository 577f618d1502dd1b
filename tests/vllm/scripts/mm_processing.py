"""Run in .venv-vllm: vLLM's own multimodal input processing on gymbridge's prompts.

gymbridge renders a chat with images, a video and audio through its ``ChatCodec`` over the tiny
models (gymbridge.testing): that is the prompt a trajectory records, every placeholder expanded.
``VLLMGenerator.build_request`` turns it into the ``TokensPrompt`` it sends (one placeholder per
item, audio mono at the feature extractor's rate). vLLM's renderer then processes that prompt the
way ``AsyncLLM.generate`` does (``parse_model_prompt`` + ``Renderer.render_cmpl``: its HF processor
on the media, its own placeholder expansion) with the tiny model saved as a real checkpoint (the
real ``Qwen2VLProcessor`` / ``Qwen2_5OmniProcessor`` configured like gymbridge's tiny processors).
The prompt ids vLLM would run must equal the recorded ones.

Prints ``{case: {"recorded": n, "vllm": n, "equal": bool, "first_difference": i | null}}``; the
``*_raw_layout`` control hands vLLM the clip as gymbridge decodes it (samples x channels at its
own rate), which is what the backend did before.
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np


def wav_data_url(seconds: float, rate: int, channels: int) -> str:
    import soundfile as sf

    from gymbridge.media import encode_data_url

    t = np.arange(round(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * 440 * t)
    wave = np.stack([tone * (0.5 + 0.5 * c) for c in range(channels)], axis=1) if channels > 1 else tone
    buf = io.BytesIO()
    sf.write(buf, wave.astype(np.float32), rate, format="WAV")
    return encode_data_url(buf.getvalue(), "audio/wav")


def png_data_url(size: tuple[int, int], color: tuple[int, int, int]) -> str:
    from PIL import Image

    from gymbridge.media import encode_data_url

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return encode_data_url(buf.getvalue(), "image/png")


def mp4_data_url(num_frames: int, size: int) -> str:
    import av

    from gymbridge.media import encode_data_url

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=2)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            frame = np.zeros((size, size, 3), np.uint8)
            frame[4 + 4 * i : 16 + 4 * i, 8:20] = (255, 255, 0)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return encode_data_url(buf.getvalue(), "video/mp4")


def recorded_input(codec: Any, parts: list[dict[str, Any]]) -> Any:
    """gymbridge's own rendering of one user turn: the recorded prompt and its decoded media."""
    from gymbridge.generation.chat import chat_to_messages
    from gymbridge.generation.outputs import generation_input_from_prompt

    rendered = codec.render(chat_to_messages([{"role": "user", "content": parts}]))
    return generation_input_from_prompt(rendered.prompt_token_ids, rendered.media)


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def audio_part(url: str) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": url}}


def video_part(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


# ----------------------------------------------------------------------------- checkpoints


def special_token_names(tokenizer_dir: Path, names: dict[str, str]) -> None:
    """Name the tiny tokenizer's media tokens the way Qwen2.5-Omni's processor reads them."""
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["extra_special_tokens"] = names
    config_path.write_text(json.dumps(config))


def tiny_video_pixels() -> dict[str, int]:
    """The frame area bounds of gymbridge's tiny video processor, in the real processor's terms."""
    from gymbridge.models.tiny_omni import TinyVideoProcessor

    tiny = TinyVideoProcessor()
    return {"shortest_edge": tiny.min_pixels, "longest_edge": tiny.max_pixels}


def video_settings(image: Any) -> dict[str, Any]:
    """The real video processor set up like the image one (patch, merge, temporal patch, pixels)."""
    return {
        "patch_size": image.patch_size,
        "temporal_patch_size": image.temporal_patch_size,
        "merge_size": image.merge_size,
        "size": dict(image.size),
    }


def save_tiny_vlm(root: Path) -> tuple[Path, Any]:
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from gymbridge.models.tiny_vlm import build_tiny_vlm

    tiny = build_tiny_vlm(0)
    out = root / "qwen2_vl"
    tiny.model.config.save_pretrained(out)
    image = Qwen2VLImageProcessor.from_dict(tiny.processor.image_processor.to_dict())
    video = Qwen2VLVideoProcessor(**{**video_settings(image), "size": tiny_video_pixels()})
    processor = Qwen2VLProcessor(
        image_processor=image,
        video_processor=video,
        tokenizer=tiny.tokenizer,
        chat_template=tiny.tokenizer.chat_template,
    )
    processor.save_pretrained(out)
    return out, tiny


def save_tiny_omni(root: Path) -> tuple[Path, Any]:
    from transformers import (
        Qwen2_5OmniConfig,
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    from gymbridge.models import tiny_vlm
    from gymbridge.models.tiny_omni import build_tiny_omni, tiny_feature_extractor

    tiny = build_tiny_omni(0)
    out = root / "qwen2_5_omni"
    whole = Qwen2_5OmniConfig(thinker_config=tiny.model.config.to_dict(), enable_audio_output=False)
    whole.architectures = ["Qwen2_5OmniModel"]
    whole.save_pretrained(out)
    tiny.tokenizer.save_pretrained(out)
    special_token_names(
        out,
        {
            "image_token": tiny_vlm.IMAGE_PAD,
            "video_token": tiny_vlm.VIDEO_PAD,
            "audio_token": tiny_vlm.AUDIO_PAD,
            "vision_bos_token": tiny_vlm.VISION_START,
            "vision_eos_token": tiny_vlm.VISION_END,
            "audio_bos_token": tiny_vlm.AUDIO_START,
            "audio_eos_token": tiny_vlm.AUDIO_END,
        },
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    image = Qwen2VLImageProcessor.from_dict(tiny.processor.image_processor.to_dict())
    video = Qwen2VLVideoProcessor(**{**video_settings(image), "size": tiny_video_pixels()})
    processor = Qwen2_5OmniProcessor(
        image_processor=image,
        video_processor=video,
        feature_extractor=tiny_feature_extractor(),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    processor.save_pretrained(out)
    return out, tiny


# ----------------------------------------------------------------------------- vLLM's side


class VLLMRenderer:
    """vLLM's prompt rendering for one saved model, as ``AsyncLLM`` builds it (no engine)."""

    def __init__(
        self, model_dir: Path, limits: dict[str, int], mm_kwargs: dict[str, Any] | None = None
    ) -> None:
        from vllm.config import DeviceConfig, ModelConfig, VllmConfig
        from vllm.renderers.registry import renderer_from_config

        model_config = ModelConfig(
            model=str(model_dir),
            max_model_len=4096,
            limit_mm_per_prompt=limits,
            dtype="float32",
            mm_processor_kwargs=mm_kwargs,
        )
        self.config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
        self.renderer = renderer_from_config(self.config)
        self.hf_config = model_config.hf_config

    def prompt_ids(self, prompt: Any) -> list[int]:
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        parsed = parse_model_prompt(self.config.model_config, prompt)
        (engine_input,) = self.renderer.render_cmpl([parsed], self.renderer.default_cmpl_tok_params)
        return [int(t) for t in engine_input["prompt_token_ids"]]


def compare(recorded: list[int], ran: list[int]) -> dict[str, Any]:
    first = next((i for i, (a, b) in enumerate(zip(recorded, ran, strict=False)) if a != b), None)
    if first is None and len(recorded) != len(ran):
        first = min(len(recorded), len(ran))
    return {"recorded": len(recorded), "vllm": len(ran), "equal": recorded == ran, "first_difference": first}


def sent_prompt(inp: Any, hf_config: Any, processor: Any) -> Any:
    """What ``VLLMGenerator`` sends for ``inp`` (its ``build_request``, no engine)."""
    from gymbridge.generation.types import SamplingConfig
    from gymbridge.generation.vllm import VLLMGenerator

    model_config = types.SimpleNamespace(hf_config=hf_config, max_model_len=4096)
    engine = types.SimpleNamespace(model_config=model_config)
    gen = VLLMGenerator("unused", engine=engine, processor=processor)
    prompt, _ = gen.build_request(inp, SamplingConfig())
    return prompt


def main() -> None:
    from gymbridge.generation.chat import ChatCodec
    from gymbridge.models.tiny_omni import TinyVideoProcessor
    from gymbridge.models.tiny_vlm import TinyVLMProcessor

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        vlm_dir, vlm = save_tiny_vlm(root)
        vllm_vlm = VLLMRenderer(vlm_dir, {"image": 4, "video": 2})
        # the tiny Qwen2-VL's processor takes images only; gymbridge's own video processing is added
        vlm_processor = TinyVLMProcessor(vlm.tokenizer, vlm.processor.image_processor, TinyVideoProcessor())
        codec = ChatCodec(vlm_processor)
        red, blue = png_data_url((64, 48), (255, 0, 0)), png_data_url((90, 120), (0, 0, 255))
        video = mp4_data_url(4, 64)
        cases = {
            "qwen2_vl_one_image": [image_part(red), text_part("What color?")],
            "qwen2_vl_two_images": [image_part(red), text_part("and"), image_part(blue), text_part("same?")],
            "qwen2_vl_video": [video_part(video), text_part("What moves?")],
            "qwen2_vl_image_and_video": [image_part(blue), video_part(video), text_part("Both?")],
        }
        for name, parts in cases.items():
            inp = recorded_input(codec, parts)
            prompt = sent_prompt(inp, vllm_vlm.hf_config, vlm_processor)
            results[name] = compare(inp.prompt_token_ids, vllm_vlm.prompt_ids(prompt))

        omni_dir, omni = save_tiny_omni(root)
        vllm_omni = VLLMRenderer(omni_dir, {"image": 4, "video": 2, "audio": 4})
        codec = ChatCodec(omni.processor)
        stereo = wav_data_url(1.0, 44100, 2)
        cases = {
            "omni_image": [image_part(red), text_part("What color?")],
            "omni_audio_mono_16k": [audio_part(wav_data_url(1.0, 16000, 1)), text_part("What sound?")],
            "omni_audio_stereo_44k": [audio_part(stereo), text_part("What sound?")],
            "omni_image_and_audio": [
                image_part(blue),
                audio_part(wav_data_url(0.7, 22050, 1)),
                text_part("Both?"),
            ],
        }
        for name, parts in cases.items():
            inp = recorded_input(codec, parts)
            prompt = sent_prompt(inp, vllm_omni.hf_config, omni.processor)
            results[name] = compare(inp.prompt_token_ids, vllm_omni.prompt_ids(prompt))
            if name == "omni_audio_stereo_44k":  # the control: the clip as decoded, as sent before the fix
                raw = dict(prompt)
                raw["multi_modal_data"] = {"audio": list(inp.multi_modal_data["audio"])}
                results[name + "_raw_layout"] = compare(inp.prompt_token_ids, vllm_omni.prompt_ids(raw))
        # Qwen2_5OmniProcessor imposes the real model's video frame area (128..768 x 28 x 28) on every
        # call; the tiny model's smaller frames are passed as the engine's mm_processor_kwargs
        pixels = tiny_video_pixels()
        sized = {"min_pixels": pixels["shortest_edge"], "max_pixels": pixels["longest_edge"]}
        vllm_omni_video = VLLMRenderer(omni_dir, {"video": 2, "audio": 4}, sized)
        cases = {
            "omni_video": [video_part(video), text_part("What moves?")],
            "omni_video_and_audio": [video_part(video), audio_part(stereo), text_part("Both?")],
        }
        for name, parts in cases.items():
            inp = recorded_input(codec, parts)
            prompt = sent_prompt(inp, vllm_omni_video.hf_config, omni.processor)
            results[name] = compare(inp.prompt_token_ids, vllm_omni_video.prompt_ids(prompt))
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
