"""Measure what masking media tokens does to the tiny model's reported logprobs.

``HFGenerator`` never samples media placeholder / vision boundary ids (logits -inf), so the
logprobs it reports are of the masked, renormalised distribution. This script samples 8
image prompts x 24 tokens and compares those logprobs with one teacher-forced forward of the
model, scored **with** the same mask and **without** it: the first difference is numerical
noise, the second is the mass the random tiny model puts on the masked ids (which is why
``token_logprobs`` in the trainer applies the same mask).

    .venv/bin/python examples/measure_media_mask.py
"""

from __future__ import annotations

import asyncio
import io

import torch
from PIL import Image

from gymbridge.generation.chat import chat_to_messages
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.outputs import generation_input_from_prompt
from gymbridge.generation.types import SamplingConfig
from gymbridge.media import encode_data_url
from gymbridge.trajectory.types import GenerationInput


def _input(gen: HFGenerator, i: int) -> GenerationInput:
    buf = io.BytesIO()
    Image.new("RGB", (48, 40), (40 * i % 256, 90, 200)).save(buf, "PNG")
    parts = [
        {"type": "image_url", "image_url": {"url": encode_data_url(buf.getvalue(), "image/png")}},
        {"type": "text", "text": f"Describe picture {i}."},
    ]
    rendered = gen.codec.render(chat_to_messages([{"role": "user", "content": parts}]))
    return generation_input_from_prompt(rendered.prompt_token_ids, rendered.media)


def _teacher_forced(
    gen: HFGenerator, inp: GenerationInput, toks: list[int], t: float, mask: bool
) -> list[float]:
    ids = torch.tensor([inp.prompt_token_ids + toks])
    with torch.no_grad():
        logits = gen.model(**gen.model_inputs(ids, torch.ones_like(ids), gen.media_kwargs([inp]))).logits[0]
    logits = logits.double() / t
    if mask:
        logits[:, list(gen.suppressed_token_ids)] = float("-inf")
    lp = torch.log_softmax(logits, dim=-1)
    n = len(inp.prompt_token_ids)
    return [float(lp[n + k - 1, tok]) for k, tok in enumerate(toks)]


def main() -> None:
    gen = HFGenerator.tiny(0)
    inputs = [_input(gen, i) for i in range(8)]
    print(f"masked ids: {gen.suppressed_token_ids}")
    for temperature in (1.0, 0.7):
        sampling = SamplingConfig(temperature=temperature, max_tokens=24, seed=1)
        outs = asyncio.run(gen.generate(inputs, sampling))
        diffs = {True: 0.0, False: 0.0}
        for inp, out in zip(inputs, outs, strict=True):
            for mask in diffs:
                ref = _teacher_forced(gen, inp, out.token_ids, temperature, mask)
                diffs[mask] = max(
                    diffs[mask], max(abs(a - b) for a, b in zip(out.logprobs, ref, strict=True))
                )
        print(
            f"T={temperature}: max |generator - teacher-forced| with the mask {diffs[True]:.2e}, "
            f"without it {diffs[False]:.2e}"
        )


if __name__ == "__main__":
    main()
