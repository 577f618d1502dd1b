"""Generation: token-in / token-out backends, chat templating, and the model server.

Public API (stable): :class:`Generator` (the protocol), :class:`SamplingConfig`,
:class:`Generation`, :class:`GenerationInput` (re-exported from the trajectory
layer, which builds it), :class:`HFGenerator` (transformers), :class:`VLLMGenerator`
(vLLM, the ``vllm`` extra, imported lazily), :class:`ChatCodec` (templating with an
exact prefix splice, reasoning / tool-call parsing), :class:`BatchingGenerator`,
:class:`ModelServer`, :class:`ScriptedGenerator` (forced turns for tests), and the sampling
seeds of a rollout (:func:`rollout_seed`, :class:`PromptSeededGenerator`).

Heavy modules (transformers, aiohttp, vLLM) are imported on first attribute
access, so ``import gymbridge.generation`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gymbridge.generation.types import ContextLengthError, FinishReason, Generation, Generator, SamplingConfig
from gymbridge.trajectory.types import GenerationInput

if TYPE_CHECKING:
    from gymbridge.generation.batching import BatchingGenerator
    from gymbridge.generation.chat import ChatCodec, ChatMessage, ParsedOutput, RenderedPrompt, ToolCall
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.generation.scripted import ScriptedGenerator
    from gymbridge.generation.seeding import PromptSeededGenerator, rollout_seed
    from gymbridge.generation.server import ModelServer, ModelServerConfig
    from gymbridge.generation.vllm import VLLMGenerator

__all__ = [
    "BatchingGenerator",
    "ChatCodec",
    "ChatMessage",
    "ContextLengthError",
    "FinishReason",
    "Generation",
    "GenerationInput",
    "Generator",
    "HFGenerator",
    "ModelServer",
    "ModelServerConfig",
    "ParsedOutput",
    "PromptSeededGenerator",
    "RenderedPrompt",
    "SamplingConfig",
    "ScriptedGenerator",
    "ToolCall",
    "VLLMGenerator",
    "rollout_seed",
]

_LAZY: dict[str, str] = {
    "BatchingGenerator": "gymbridge.generation.batching",
    "ChatCodec": "gymbridge.generation.chat",
    "ChatMessage": "gymbridge.generation.chat",
    "ParsedOutput": "gymbridge.generation.chat",
    "RenderedPrompt": "gymbridge.generation.chat",
    "ToolCall": "gymbridge.generation.chat",
    "HFGenerator": "gymbridge.generation.hf",
    "ModelServer": "gymbridge.generation.server",
    "ModelServerConfig": "gymbridge.generation.server",
    "ScriptedGenerator": "gymbridge.generation.scripted",
    "PromptSeededGenerator": "gymbridge.generation.seeding",
    "rollout_seed": "gymbridge.generation.seeding",
    "VLLMGenerator": "gymbridge.generation.vllm",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gymbridge.generation' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
