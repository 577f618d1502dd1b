"""``BridgeConfig``: how the bridge turns dataset rows into training batches (a run's ``bridge:`` section).

The settings of :class:`~gymbridge.bridge.BridgeIterator` that shape what is trained: the group
size and the groups per batch, which groups are trained (failed rollouts, staleness, dynamic
sampling), the group advantages and media deduplication. The iterator's collaborators (the
rollout source, the media processor, the failures file, the payload meter) are passed beside it.

Invariant: these defaults are the only ones; a run's config holds this model as its ``bridge:``
section, so nothing else restates them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gymbridge.config import StrictModel
from gymbridge.tensors.batch import AdvantageMode

__all__ = ["BridgeConfig"]


class BridgeConfig(StrictModel):
    """The ``bridge:`` section; every field is a :class:`~gymbridge.bridge.BridgeIterator` setting."""

    group_size: int = Field(8, ge=1)
    """G: rollouts per prompt (TRL's ``num_generations``, verl's ``rollout.n``)."""
    prompts_per_step: int = Field(8, ge=1)
    """Groups (prompts) per training batch."""
    min_group_size: int | None = Field(2, ge=1)
    """Successful rollouts a group needs to be trained on (advantages over those); ``None``: all G."""
    max_consecutive_failed_groups: int = Field(4, ge=1)
    """Failed groups in a row before :class:`~gymbridge.errors.BridgeStalledError` (a dead agent)."""
    dedup: bool = True
    """The G rollouts of a group share one copy of each medium through every hop."""
    advantage: AdvantageMode = "group_norm"
    """Group advantages (:func:`~gymbridge.tensors.batch.group_advantages`): ``group_norm``
    ``(r - mean) / std`` (GRPO), ``group_mean`` ``r - mean`` (Dr. GRPO), ``none`` the raw reward;
    ``batch_norm`` / ``batch_mean`` the same over the step's whole batch instead of each group (a
    group that earned one reward throughout still trains: docs/grpo.md, *Group advantages*)."""
    reward_components_check: Literal["sum", "off"] = "off"
    """``sum``: a result whose ``reward_components`` do not sum to its reward is a failed rollout."""
    on_noncontiguous: Literal["error", "split"] = "error"
    """A trajectory whose turns do not extend each other's tokens: a failed rollout, or split rows."""
    max_staleness: int = Field(0, ge=0)
    """``k``: 0 trains on-policy (a batch's rollouts start when it is asked for); ``k > 0`` runs the
    next ``k`` batches' rollouts while the trainer trains and drops (records as ``stale``) a group
    more than ``k`` policy versions old."""
    drop_stale: bool = True
    """Drop groups over the staleness bound; ``False`` hands them to the trainer for its drift guard."""
    dynamic_sampling: bool = False
    """DAPO: zero-variance groups are left out (recorded) and replaced by new prompts."""
    dynamic_sampling_max_rounds: int = Field(2, ge=0)
    """Extra rounds of ``prompts_per_step`` prompts one batch may draw to replace zero-variance groups."""
    drop_last: bool = False
    """Drop a final batch with fewer than ``prompts_per_step`` groups (recorded) instead of yielding it."""

    @model_validator(mode="after")
    def _group_sizes(self) -> BridgeConfig:
        if self.min_group_size is not None and self.min_group_size > self.group_size:
            raise ValueError(
                f"min_group_size ({self.min_group_size}) is larger than group_size ({self.group_size})"
            )
        return self

    @property
    def min_group(self) -> int:
        """``min_group_size`` with ``None`` resolved to G."""
        return self.group_size if self.min_group_size is None else self.min_group_size
