"""Media-vs-placeholder check: a turn's media must match the placeholders in its prompt delta.

docs/design.md ("Trajectories") makes this the trajectory layer's check: a turn that carries images but
whose tokens hold no image placeholders (or the other way round) is an error, not a
silent attach. It needs the model's placeholder token ids, which the walk does not
know, so it is a separate function (also reachable through
``from_gym_result(..., placeholder_token_ids=...)``).

Counting rule: the number of media items of modality ``m`` in ``turn.media`` equals the
number of **runs** of ``placeholder_token_ids[m]`` in ``turn.prompt_token_ids`` (a run
is a maximal block of consecutive placeholder tokens: Qwen2-VL expands each image to
``<|vision_start|>`` + N x ``<|image_pad|>`` + ``<|vision_end|>``, so one run per image,
expanded or not). With ``count="token"`` every placeholder token counts as one item
(models that write exactly one token per item and may put two side by side).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from gymbridge.errors import TrajectoryError
from gymbridge.trajectory.types import Trajectory

__all__ = ["PlaceholderCount", "check_media_placeholders", "count_placeholders"]

PlaceholderCount = Literal["run", "token"]


def count_placeholders(token_ids: Sequence[int], placeholder: int, *, count: PlaceholderCount = "run") -> int:
    """How many media items ``token_ids`` references through ``placeholder``."""
    if count == "token":
        return list(token_ids).count(placeholder)
    runs = 0
    previous_was_placeholder = False
    for token in token_ids:
        is_placeholder = token == placeholder
        if is_placeholder and not previous_was_placeholder:
            runs += 1
        previous_was_placeholder = is_placeholder
    return runs


def check_media_placeholders(
    trajectory: Trajectory,
    placeholder_token_ids: Mapping[str, int],
    *,
    count: PlaceholderCount = "run",
) -> None:
    """Raise ``TrajectoryError`` (naming the turn's output item) where media and placeholders disagree.

    ``placeholder_token_ids`` maps a modality (``"image"``, ``"audio"``, ``"video"``) to
    its placeholder token id; modalities left out are not checked.
    """
    for turn in trajectory.turns:
        for modality, placeholder in placeholder_token_ids.items():
            n_media = sum(1 for item in turn.media if item.modality == modality)
            n_placeholders = count_placeholders(turn.prompt_token_ids, placeholder, count=count)
            if n_media != n_placeholders:
                raise TrajectoryError(
                    f"turn {turn.index} carries {n_media} {modality} item(s) but its prompt tokens hold "
                    f"{n_placeholders} {modality} placeholder(s) (token id {placeholder}); the media index "
                    "and the token stream disagree",
                    item_index=turn.item_index,
                )
