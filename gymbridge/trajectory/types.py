"""Trajectory data model: per-turn trainable segments of one rollout.

A **turn** is exactly one output item with a non-empty ``generation_token_ids``
(``message``, ``reasoning`` or ``function_call``). Turns are grouped into
**segments**: a segment is one training sequence whose token history only ever
appends. A trajectory has one segment unless its history was non-appending and
the ``"split"`` policy started a new one.

Invariants (checked where a ``Trajectory`` is built, see ``from_gym_result``):

* ``len(turn.generation_logprobs) == len(turn.generation_token_ids) > 0``;
* ``turn.prompt_token_ids`` is the *delta*: the prompt tokens new since the
  previous turn of the same segment (the full prompt for a segment's first turn);
* ``token_ids(s)`` is the concatenation, over the turns of segment ``s`` in
  order, of ``prompt_token_ids + generation_token_ids``; ``loss_mask(s)`` is 1
  exactly on generated tokens; ``logprobs(s)`` is the generation logprob there
  and 0.0 elsewhere. The three views are aligned and of equal length;
* ``turn.media`` holds the media that arrived since the previous turn (the first
  turn owns the initial media), in order of appearance; the first turn of a later
  segment owns every media item of the conversation so far, because its prompt is
  the whole conversation re-rendered (placeholders for all of them);
* ``turn.routed_experts``, when present, has one ``[layers][topk]`` row per token of
  ``prompt_token_ids + generation_token_ids`` (``-1`` where the result carried none);
* ``reward`` is finite; ``reward_components`` are the environment's components as given
  (they sum to ``reward`` only when ``from_gym_result(..., reward_components_check="sum")``
  checked it: Gym makes ``reward`` the aggregate, not necessarily the sum);
* ``turn.policy_version`` is the policy version that produced the turn (the item's
  ``policy_version`` field; ``None`` when the server did not say). A multi-turn episode
  can straddle a weight update, so its turns may carry different versions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from gymbridge.media import MediaItem

TurnKind = Literal["message", "reasoning", "function_call"]

__all__ = ["GenerationInput", "Trajectory", "Turn", "TurnKind"]


@dataclass(frozen=True, slots=True)
class Turn:
    """One model call's trainable output item."""

    index: int
    """Position of this turn among the trajectory's turns (0-based)."""
    item_index: int
    """Index of the producing item in ``response.output``."""
    kind: TurnKind
    segment: int
    prompt_token_ids: list[int]
    """New prompt tokens since the previous turn of the same segment."""
    generation_token_ids: list[int]
    generation_logprobs: list[float]
    media: list[MediaItem] = field(default_factory=list)
    tool_name: str | None = None
    """Name of the called tool for a ``function_call`` turn."""
    tool_names: list[str] = field(default_factory=list)
    """Every tool the producing model call invoked, in order (parallel calls put the
    token fields on the last ``function_call`` only)."""
    invalid_tool_call: bool = False
    """Tool-call markup was left in plain text instead of becoming a function_call."""
    malformed_thinking: bool = False
    """Think tags leaked into an answer message."""
    policy_version: int | None = None
    """The policy version that generated this turn (``None``: the server did not report one)."""
    routed_experts: list[list[list[int]]] | None = None
    """MoE router replay: ``[len(prompt_token_ids) + len(generation_token_ids)][layers][topk]``
    expert ids (``-1``: not carried), or ``None`` when the result carried none."""


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One rollout's trainable turns plus its outcome."""

    turns: list[Turn]
    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    mask_sample: bool = False
    truncated: bool = False
    task_index: int | None = None
    rollout_index: int | None = None
    failure_class: str | None = None
    failure_reason: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def policy_versions(self) -> list[int]:
        """The turns' known policy versions, in turn order (turns without one are left out)."""
        return [t.policy_version for t in self.turns if t.policy_version is not None]

    @property
    def oldest_policy_version(self) -> int | None:
        """The oldest policy version among the turns; ``None`` when no turn reports one."""
        versions = self.policy_versions
        return min(versions) if versions else None

    @property
    def num_segments(self) -> int:
        return 1 + max((t.segment for t in self.turns), default=0)

    def segment_turns(self, segment: int = 0) -> list[Turn]:
        if not 0 <= segment < self.num_segments:
            raise IndexError(f"segment {segment} out of range (trajectory has {self.num_segments})")
        return [t for t in self.turns if t.segment == segment]

    def token_ids(self, segment: int = 0) -> list[int]:
        """Full token sequence of a segment ``[L]``: every prompt delta and generation in order."""
        out: list[int] = []
        for t in self.segment_turns(segment):
            out.extend(t.prompt_token_ids)
            out.extend(t.generation_token_ids)
        return out

    def loss_mask(self, segment: int = 0) -> list[int]:
        """``[L]``, 1 on generated tokens, 0 on prompt / observation tokens."""
        out: list[int] = []
        for t in self.segment_turns(segment):
            out.extend([0] * len(t.prompt_token_ids))
            out.extend([1] * len(t.generation_token_ids))
        return out

    def logprobs(self, segment: int = 0) -> list[float]:
        """``[L]``, the generation logprob on generated tokens, 0.0 elsewhere."""
        out: list[float] = []
        for t in self.segment_turns(segment):
            out.extend([0.0] * len(t.prompt_token_ids))
            out.extend(t.generation_logprobs)
        return out

    def routed_experts(self, segment: int = 0) -> list[list[list[int]]] | None:
        """``[L][layers][topk]`` routes aligned with :meth:`token_ids`, ``None`` when no turn has any.

        A turn without routes (in a segment where others have them) gets ``-1`` rows.
        """
        turns = self.segment_turns(segment)
        shaped = next((t.routed_experts for t in turns if t.routed_experts), None)
        if shaped is None:
            return None
        blank = [[-1] * len(shaped[0][0]) for _ in shaped[0]]
        out: list[list[list[int]]] = []
        for t in turns:
            if t.routed_experts is not None:
                out.extend(t.routed_experts)
            else:
                n = len(t.prompt_token_ids) + len(t.generation_token_ids)
                out.extend([[list(layer) for layer in blank] for _ in range(n)])
        return out

    def media(self, segment: int = 0) -> list[MediaItem]:
        """All media of a segment, in order of appearance."""
        return [m for t in self.segment_turns(segment) for m in t.media]


@dataclass(frozen=True, slots=True)
class GenerationInput:
    """What a generator receives for one model call (built by ``build_generation_input``).

    ``prompt_token_ids`` is the full current token sequence (placeholders already
    expanded); ``multi_modal_data`` holds **all** media of the conversation so far by
    modality, in order, decoded (``{"image": [PIL.Image, ...], "audio": [(wave, sr)],
    "video": [frames]}``), the shape vLLM's ``TokensPrompt`` takes. It is empty for
    a text-only history. ``media`` keeps the undecoded ``MediaItem`` s, in the same
    order, so backends can re-process or hash them.
    """

    prompt_token_ids: list[int]
    multi_modal_data: dict[str, list[Any]] = field(default_factory=dict)
    media: list[MediaItem] = field(default_factory=list)
