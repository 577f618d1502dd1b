"""The refresh rule: the prompt of every model call is the *current* conversation.

A native rollout keeps one :class:`ConversationHistory` and appends to it: the
initial prompt tokens with the initial media, each generation, each observation
(its tokens and its media). :func:`build_generation_input` turns the history into
the :class:`~gymbridge.trajectory.GenerationInput` for the next call: the full
token sequence so far and **all** media so far, by modality, in order of
appearance, decoded into the shape vLLM's ``TokensPrompt.multi_modal_data`` takes.
It is the one place that builds a prompt; every generation backend calls it.

Invariants:

* the history only appends (tokens and media); the ``GenerationInput`` it yields
  owns copies, so later appends never change an input already handed out;
* ``multi_modal_data`` has a key only for modalities present, so a text-only
  history gives ``{}``; ``multi_modal_data[m]`` lists the media of modality ``m``
  in the order they entered the history;
* decoding goes through ``MediaItem.image()`` / ``.audio()`` / ``.video()`` and
  happens at most once per media item of a history (the result is cached), so a
  rollout of T turns decodes each image once, not T times. Decode failures raise
  the media layer's ``MediaError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gymbridge.trajectory.types import GenerationInput, Trajectory

if TYPE_CHECKING:
    from gymbridge.media import MediaItem

__all__ = ["ConversationHistory", "build_generation_input"]


@dataclass(slots=True)
class ConversationHistory:
    """The conversation so far: every token (prompts, generations, observations) and every media item.

    ``token_ids`` is ``[L]``, the exact token stream the model has seen plus what it
    generated; ``media`` holds the media in order of appearance (their placeholders
    are inside ``token_ids``). ``decoder`` (default ``MediaItem.image()`` / ``.audio()`` /
    ``.video()``) decodes one item, e.g. through the model server's cache by content key.
    """

    token_ids: list[int] = field(default_factory=list)
    media: list[MediaItem] = field(default_factory=list)
    decoder: Callable[[MediaItem], Any] | None = field(default=None, repr=False, compare=False)
    _decoded: list[tuple[MediaItem, Any]] = field(default_factory=list, repr=False, compare=False)

    def append(self, token_ids: Sequence[int] = (), media: Sequence[MediaItem] = ()) -> None:
        """Append tokens (a prompt, a generation or an observation) and the media they reference."""
        self.token_ids.extend(token_ids)
        self.media.extend(media)

    @classmethod
    def from_trajectory(cls, trajectory: Trajectory, turn: int) -> ConversationHistory:
        """The conversation as it stood when ``trajectory.turns[turn]`` was generated.

        Holds every earlier turn of the same segment (prompt delta + generation), then
        the turn's own prompt delta, with the media of those turns. So
        ``build_generation_input(ConversationHistory.from_trajectory(t, k)).prompt_token_ids``
        is turn ``k``'s full prompt.
        """
        if not 0 <= turn < len(trajectory.turns):
            raise IndexError(f"turn {turn} out of range (trajectory has {len(trajectory.turns)} turns)")
        target = trajectory.turns[turn]
        history = cls()
        for earlier in trajectory.turns[:turn]:
            if earlier.segment == target.segment:
                history.append(earlier.prompt_token_ids, earlier.media)
                history.append(earlier.generation_token_ids)
        history.append(target.prompt_token_ids, target.media)
        return history

    def decoded_media(self) -> list[Any]:
        """Each media item decoded (PIL image, ``(waveform, sample_rate)``, frames ``[T, H, W, C]``)."""
        cache = self._decoded
        for position, item in enumerate(self.media):
            if position < len(cache) and cache[position][0] is item:
                continue
            del cache[position:]  # the media list was edited in place: re-decode from here on
            cache.append((item, (self.decoder or _decode)(item)))
        del cache[len(self.media) :]
        return [decoded for _, decoded in cache]


def _decode(item: MediaItem) -> Any:
    if item.modality == "image":
        return item.image()
    if item.modality == "audio":
        return item.audio()
    if item.modality == "video":
        return item.video()
    raise ValueError(f"unknown modality {item.modality!r}")


def build_generation_input(history: ConversationHistory) -> GenerationInput:
    """The input of the next model call: all tokens so far and all media so far, decoded.

    ``multi_modal_data`` is ``{"image": [...], "video": [...], "audio": [...]}`` with
    only the modalities present (``{}`` for a text-only history).
    """
    multi_modal_data: dict[str, list[Any]] = {}
    for item, decoded in zip(history.media, history.decoded_media(), strict=True):
        multi_modal_data.setdefault(item.modality, []).append(decoded)
    return GenerationInput(
        prompt_token_ids=list(history.token_ids),
        multi_modal_data=multi_modal_data,
        media=list(history.media),
    )
