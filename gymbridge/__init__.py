"""gymbridge: NeMo Gym environment servers -> multimodal, multi-turn GRPO batches.

The flat public API below is re-exported from the subpackages. Imports are lazy
(PEP 562): ``import gymbridge`` stays cheap and pulls torch / transformers only
when a name that needs them is first used. ``__all__`` is sorted and a test
checks that every name resolves.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # errors
    "CheckEnvError": "gymbridge.errors",
    "CheckpointError": "gymbridge.errors",
    "ConfigError": "gymbridge.errors",
    "EnvError": "gymbridge.errors",
    "EnvFaultError": "gymbridge.errors",
    "EnvServerError": "gymbridge.errors",
    "EnvTimeoutError": "gymbridge.errors",
    "EnvTransportError": "gymbridge.errors",
    "GymbridgeError": "gymbridge.errors",
    "MediaDecodeError": "gymbridge.errors",
    "MediaError": "gymbridge.errors",
    "MediaFetchError": "gymbridge.errors",
    "MediaPolicyError": "gymbridge.errors",
    "ProtocolError": "gymbridge.errors",
    "TrajectoryError": "gymbridge.errors",
    # config
    "load_config": "gymbridge.config",
    # media
    "MediaItem": "gymbridge.media",
    "MediaPolicy": "gymbridge.media",
    "load_media": "gymbridge.media",
    # trajectory
    "ConversationHistory": "gymbridge.trajectory",
    "GenerationInput": "gymbridge.trajectory",
    "Trajectory": "gymbridge.trajectory",
    "Turn": "gymbridge.trajectory",
    "build_generation_input": "gymbridge.trajectory",
    "from_gym_result": "gymbridge.trajectory",
    # tensors + metrics
    "MediaProcessor": "gymbridge.tensors",
    "PackedTensor": "gymbridge.tensors",
    "TrainBatch": "gymbridge.tensors",
    "PayloadMeter": "gymbridge.metrics",
    "payload_stats": "gymbridge.metrics",
    # HTTP
    "GymClient": "gymbridge.client",
    "RolloutOutcome": "gymbridge.client",
    "ResourcesServer": "gymbridge.server",
    "SimpleAgent": "gymbridge.server",
    "check_env": "gymbridge.server",
    "serve": "gymbridge.server",
    # generation + rollouts
    "Generator": "gymbridge.generation",
    "HFGenerator": "gymbridge.generation",
    "VLLMGenerator": "gymbridge.generation",
    "run_episode": "gymbridge.rollout",
    # bridge (rollout sources -> batches) + trainer
    "BridgeIterator": "gymbridge.bridge",
    "GymRollouts": "gymbridge.bridge",
    "NativeRollouts": "gymbridge.bridge",
    "RolloutSource": "gymbridge.bridge",
    "GRPOConfig": "gymbridge.trainer",
    "GRPOTrainer": "gymbridge.trainer",
}

__all__ = [
    "BridgeIterator",
    "CheckEnvError",
    "CheckpointError",
    "ConfigError",
    "ConversationHistory",
    "EnvError",
    "EnvFaultError",
    "EnvServerError",
    "EnvTimeoutError",
    "EnvTransportError",
    "GRPOConfig",
    "GRPOTrainer",
    "GenerationInput",
    "Generator",
    "GymClient",
    "GymRollouts",
    "GymbridgeError",
    "HFGenerator",
    "MediaDecodeError",
    "MediaError",
    "MediaFetchError",
    "MediaItem",
    "MediaPolicy",
    "MediaPolicyError",
    "MediaProcessor",
    "NativeRollouts",
    "PackedTensor",
    "PayloadMeter",
    "ProtocolError",
    "ResourcesServer",
    "RolloutOutcome",
    "RolloutSource",
    "SimpleAgent",
    "TrainBatch",
    "Trajectory",
    "TrajectoryError",
    "Turn",
    "VLLMGenerator",
    "build_generation_input",
    "check_env",
    "from_gym_result",
    "load_config",
    "load_media",
    "payload_stats",
    "run_episode",
    "serve",
]

if TYPE_CHECKING:
    from gymbridge.bridge import BridgeIterator, GymRollouts, NativeRollouts, RolloutSource
    from gymbridge.client import GymClient, RolloutOutcome
    from gymbridge.config import load_config
    from gymbridge.errors import (
        CheckEnvError,
        CheckpointError,
        ConfigError,
        EnvError,
        EnvServerError,
        EnvTimeoutError,
        EnvTransportError,
        GymbridgeError,
        MediaDecodeError,
        MediaError,
        MediaFetchError,
        MediaPolicyError,
        ProtocolError,
        TrajectoryError,
    )
    from gymbridge.generation import Generator, HFGenerator, VLLMGenerator
    from gymbridge.media import MediaItem, MediaPolicy, load_media
    from gymbridge.metrics import PayloadMeter, payload_stats
    from gymbridge.rollout import run_episode
    from gymbridge.server import ResourcesServer, SimpleAgent, check_env, serve
    from gymbridge.tensors import MediaProcessor, PackedTensor, TrainBatch
    from gymbridge.trainer import GRPOConfig, GRPOTrainer
    from gymbridge.trajectory import (
        ConversationHistory,
        GenerationInput,
        Trajectory,
        Turn,
        build_generation_input,
        from_gym_result,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gymbridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
