"""Random single-bit flips of a safe_io state file: how many are refused (docs/security.md).

.venv/bin/python benchmarks/checkpoint_flips.py
"""

import random

import torch

from gymbridge.errors import CheckpointError
from gymbridge.safe_io import decode_state, encode_state

rng = random.Random(0)
raw = encode_state(
    {"w": torch.randn(256, 64), "ids": torch.arange(1000)}, {"step": 3, "rng": list(range(625))}
)
n = refused = 0
for _ in range(1000):
    b = bytearray(raw)
    bit = rng.randrange(len(b) * 8)
    b[bit // 8] ^= 1 << (bit % 8)
    n += 1
    try:
        decode_state(bytes(b))
    except CheckpointError:
        refused += 1
print(f"{refused} of {n} random single-bit flips refused ({len(raw)} byte file)")
