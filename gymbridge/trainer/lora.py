"""The trainer's LoRA: :mod:`gymbridge.generation.lora`, which the trainer and the generators share
(the trainer injects adapters into its policy, a generator the same ones into its model)."""

from gymbridge.generation.lora import *  # noqa: F403
from gymbridge.generation.lora import __all__ as __all__
