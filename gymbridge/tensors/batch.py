"""``TrainBatch``: the trainer's unit, with media as deduplicated ``PackedTensor`` s.

Rows: one row per trajectory **segment** (a trajectory split at a non-appending
turn gives several rows sharing its reward and advantage). Per-row fields
(``B`` rows, ``L`` the padded length):

* ``input_ids`` int64 ``[B, L]`` (right-padded with ``pad_token_id``),
  ``attention_mask`` int64 ``[B, L]``, ``loss_mask`` float32 ``[B, L]`` (1 on
  generated tokens of trainable rows), ``logprobs`` float32 ``[B, L]`` (generation
  logprobs, 0 elsewhere);
* ``advantages``, ``rewards`` float32 ``[B]``; ``group_ids``, ``sample_ids``
  (trajectory index at build time), ``segment_ids`` int64 ``[B]``; ``sample_mask``
  bool ``[B]`` (False for ``mask_sample`` trajectories: kept as rows, loss mask 0,
  advantage 0, excluded from their group's statistics: nothing silently dropped);
* ``metadata``: one dict per row (the trajectory's metadata; ``media_content_keys``: the row's
  media content keys by modality, in order — :meth:`TrainBatch.media_content_keys` /
  :meth:`TrainBatch.media_keys` summarise a batch's media per modality; ``reward_components``
  when it has any; and ``routed_experts``, int32 ``[L_row, layers, topk]`` aligned with the
  row's unpadded tokens, ``-1`` where not carried, when the result carried MoE routes for
  router replay); ``media``: output key -> ``PackedTensor`` with
  exactly ``B`` rows (row ``r`` holds row ``r``'s media in order of appearance;
  rows without media are empty rows).

Invariants: every per-row tensor and every media ``PackedTensor`` agrees on ``B``;
operations return new batches and never write into media segments; row selection
re-interns media (a shard holds only the segments its rows reference, each once).
``dedup=False`` builds the same types with one media segment per reference (copies,
fresh ids) for A/B runs: only sharing changes, not code paths.

Advantages (``advantage=``): ``"group_norm"`` ``(r - mean) / (std + eps)`` within each
group of ``group_size`` consecutive trajectories (unbiased std; 0 for a group with one
trainable sample), ``"group_mean"`` ``r - mean``, ``"none"`` ``r``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex

import torch

from gymbridge.errors import TrajectoryError
from gymbridge.tensors._serial import _rebuild_tensor, _tensor_payload
from gymbridge.tensors.packed import IndexLike, PackedTensor, _as_index, _repeat_index

if TYPE_CHECKING:
    from gymbridge.tensors.processor import MediaLike, MediaProcessor, ProcessedMedia
    from gymbridge.trajectory.types import Trajectory

logger = logging.getLogger(__name__)

__all__ = ["BATCH_ADVANTAGE_MODES", "AdvantageMode", "TrainBatch", "group_advantages"]

AdvantageMode = Literal["group_norm", "group_mean", "batch_norm", "batch_mean", "none"]
BATCH_ADVANTAGE_MODES: frozenset[str] = frozenset({"batch_norm", "batch_mean"})
"""Modes whose baseline is the whole training batch, not the group (:meth:`TrainBatch.batch_advantages`)."""

_ROW_TENSORS = (
    "input_ids",
    "attention_mask",
    "loss_mask",
    "logprobs",
    "advantages",
    "rewards",
    "group_ids",
    "sample_ids",
    "segment_ids",
    "sample_mask",
)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    mode: AdvantageMode = "group_norm",
    eps: float = 1e-6,
    sample_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages ``[T]`` for rewards ``[T]`` in consecutive groups of ``group_size``.

    Samples where ``sample_mask`` is False get 0 and do not enter their group's mean/std.
    ``batch_norm`` / ``batch_mean`` ignore the groups: all ``T`` rewards are one group, normalised
    as ``group_norm`` / ``group_mean`` (the baseline is the mean reward of everything given).
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if mode in BATCH_ADVANTAGE_MODES:
        group_size = max(rewards.numel(), 1)
        mode = "group_norm" if mode == "batch_norm" else "group_mean"
    r = rewards.to(torch.float64).reshape(-1, group_size)
    m = (
        torch.ones_like(r, dtype=torch.float64)
        if sample_mask is None
        else sample_mask.to(torch.float64).reshape(-1, group_size)
    )
    n = m.sum(dim=1, keepdim=True)
    mean = (r * m).sum(dim=1, keepdim=True) / n.clamp(min=1)
    if mode == "none":
        adv = r
    elif mode == "group_mean":
        adv = r - mean
    elif mode == "group_norm":
        var = (((r - mean) ** 2) * m).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
        std = torch.where(n > 1, var.sqrt(), torch.zeros_like(var))
        adv = (r - mean) / (std + eps)
    else:
        raise ValueError(f"unknown advantage mode {mode!r}")
    return (adv * m).reshape(-1).to(torch.float32)


def _pad_2d(rows: Sequence[torch.Tensor], length: int, value: float, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def _pad_cols(t: torch.Tensor, length: int, value: float) -> torch.Tensor:
    if t.shape[1] >= length:
        return t
    return torch.nn.functional.pad(t, (0, length - t.shape[1]), value=value)


@dataclass(frozen=True, eq=False, repr=False)
class TrainBatch:
    """Padded token tensors, GRPO fields and deduplicated media; see the module docstring."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    sample_ids: torch.Tensor
    segment_ids: torch.Tensor
    sample_mask: torch.Tensor
    media: dict[str, PackedTensor]
    metadata: tuple[dict[str, Any], ...]
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        b = self.input_ids.shape[0]
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got {tuple(self.input_ids.shape)}")
        for name in _ROW_TENSORS:
            t: torch.Tensor = getattr(self, name)
            if t.shape[0] != b:
                raise ValueError(f"{name} has {t.shape[0]} rows, input_ids has {b}")
        for name in ("attention_mask", "loss_mask", "logprobs"):
            if getattr(self, name).shape != self.input_ids.shape:
                raise ValueError(f"{name} shape {tuple(getattr(self, name).shape)} != input_ids shape")
        for key, packed in self.media.items():
            if len(packed) != b:
                raise ValueError(f"media {key!r} has {len(packed)} rows, batch has {b}")
        if len(self.metadata) != b:
            raise ValueError(f"{len(self.metadata)} metadata entries for {b} rows")

    # ------------------------------------------------------------------ build
    @classmethod
    def from_trajectories(
        cls,
        trajectories: Sequence[Trajectory],
        processor: MediaProcessor | None,
        *,
        group_size: int,
        dedup: bool = True,
        advantage: AdvantageMode = "group_norm",
        eps: float = 1e-6,
        pad_token_id: int | None = None,
    ) -> TrainBatch:
        """Build a batch from complete groups of trajectories (``group_size`` consecutive ones per group).

        Media are processed once per content key (``processor``), placeholder counts are
        checked per turn (``TrajectoryError`` naming the trajectory, turn and output item),
        and each media output key becomes a ``PackedTensor`` with one row per segment.
        """
        if group_size < 1 or len(trajectories) % group_size:
            raise ValueError(f"{len(trajectories)} trajectories do not form groups of {group_size}")
        rewards_t = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)
        if not bool(torch.isfinite(rewards_t).all()):
            bad = int((~torch.isfinite(rewards_t)).nonzero()[0])
            raise TrajectoryError(f"trajectory {bad}: reward {trajectories[bad].reward} is not finite")
        trainable = torch.tensor([not t.mask_sample for t in trajectories], dtype=torch.bool)
        adv_t = group_advantages(rewards_t, group_size, mode=advantage, eps=eps, sample_mask=trainable)

        items: list[MediaLike] = [m for t in trajectories for turn in t.turns for m in turn.media]
        processed: dict[str, ProcessedMedia] = {}
        if items:
            if processor is None:
                raise TrajectoryError("trajectories carry media but no MediaProcessor was given")
            processed = processor.process(items)

        ids_rows: list[torch.Tensor] = []
        mask_rows: list[torch.Tensor] = []
        lp_rows: list[torch.Tensor] = []
        row_traj: list[int] = []
        row_seg: list[int] = []
        metadata: list[dict[str, Any]] = []
        media_rows: list[list[ProcessedMedia]] = []
        for ti, traj in enumerate(trajectories):
            for seg in range(traj.num_segments):
                turns = traj.segment_turns(seg)
                row_media: list[ProcessedMedia] = []
                for turn in turns:
                    got = [processed[m.key] for m in turn.media]
                    if processor is not None:
                        _check_placeholders(
                            processor, ti, turn.index, turn.item_index, turn.prompt_token_ids, got
                        )
                    row_media.extend(got)
                ids_rows.append(torch.tensor(traj.token_ids(seg), dtype=torch.int64))
                mask_rows.append(torch.tensor(traj.loss_mask(seg), dtype=torch.float32))
                lp_rows.append(torch.tensor(traj.logprobs(seg), dtype=torch.float32))
                row_traj.append(ti)
                row_seg.append(seg)
                row_meta: dict[str, Any] = {
                    "task_index": traj.task_index,
                    "rollout_index": traj.rollout_index,
                    "truncated": traj.truncated,
                    "failure_class": traj.failure_class,
                    **traj.metadata,
                    "media_content_keys": _content_keys_by_modality(row_media),
                }
                if traj.reward_components:
                    row_meta["reward_components"] = dict(traj.reward_components)
                routes = traj.routed_experts(seg)
                if routes is not None:
                    row_meta["routed_experts"] = torch.tensor(routes, dtype=torch.int32)
                metadata.append(row_meta)
                media_rows.append(row_media)

        if pad_token_id is None:
            pad_token_id = processor.pad_token_id if processor is not None and processor.pad_token_id else 0
        length = max((r.numel() for r in ids_rows), default=0)
        traj_idx = torch.tensor(row_traj, dtype=torch.int64)
        row_trainable = trainable[traj_idx] if row_traj else torch.zeros(0, dtype=torch.bool)
        loss_mask = _pad_2d(mask_rows, length, 0.0, torch.float32) * row_trainable[:, None].to(torch.float32)
        media = _pack_media(media_rows, dedup=dedup)
        return cls(
            input_ids=_pad_2d(ids_rows, length, pad_token_id, torch.int64),
            attention_mask=_pad_2d([torch.ones_like(r) for r in ids_rows], length, 0, torch.int64),
            loss_mask=loss_mask,
            logprobs=_pad_2d(lp_rows, length, 0.0, torch.float32),
            advantages=adv_t[traj_idx] if row_traj else torch.zeros(0),
            rewards=rewards_t.to(torch.float32)[traj_idx] if row_traj else torch.zeros(0),
            group_ids=traj_idx // group_size,
            sample_ids=traj_idx,
            segment_ids=torch.tensor(row_seg, dtype=torch.int64),
            sample_mask=row_trainable,
            media=media,
            metadata=tuple(metadata),
            pad_token_id=int(pad_token_id),
        )

    # ------------------------------------------------------------------ read
    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens per row, int64 ``[B]``."""
        return self.attention_mask.sum(dim=1).to(torch.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def media_keys(self) -> dict[str, list[str]]:
        """Model-input keys of this batch's media by modality, e.g. ``{"audio": ["feature_attention_mask",
        "input_features"]}`` (keys gymbridge does not know the modality of are under ``"other"``)."""
        from gymbridge.tensors.processor import MEDIA_KEY_MODALITY

        out: dict[str, list[str]] = {}
        for key in sorted(self.media):
            out.setdefault(MEDIA_KEY_MODALITY.get(key, "other"), []).append(key)
        return out

    def media_content_keys(self) -> dict[str, list[str]]:
        """Distinct content keys (sha256 of the bytes) of this batch's media by modality, first-seen order."""
        out: dict[str, list[str]] = {}
        for meta in self.metadata:
            for modality, keys in (meta.get("media_content_keys") or {}).items():
                seen = out.setdefault(modality, [])
                seen.extend(k for k in keys if k not in seen)
        return out

    def modality_rows(self) -> dict[str, torch.Tensor]:
        """Per modality of this batch's media, bool ``[B]``: the rows holding at least one item of it
        (by media key, as the model's forward sees them; unknown keys count as their own modality)."""
        from gymbridge.tensors.processor import MEDIA_KEY_MODALITY

        out: dict[str, torch.Tensor] = {}
        for key, packed in self.media.items():
            modality = MEDIA_KEY_MODALITY.get(key, key)
            has = packed.segment_counts() > 0
            out[modality] = out[modality] | has if modality in out else has
        return out

    def without_loss(self) -> TrainBatch:
        """A copy whose rows train nothing: loss mask 0, ``sample_mask`` False, advantage 0 (their
        tokens and media still run through a forward, e.g. to keep FSDP ranks in lockstep)."""
        return replace(
            self,
            loss_mask=torch.zeros_like(self.loss_mask),
            sample_mask=torch.zeros_like(self.sample_mask),
            advantages=torch.zeros_like(self.advantages),
        )

    @property
    def media_physical_nbytes(self) -> int:
        return sum(p.physical_nbytes for p in self.media.values())

    @property
    def media_logical_nbytes(self) -> int:
        return sum(p.logical_nbytes for p in self.media.values())

    # ------------------------------------------------------------------ transform
    def select(self, indices: IndexLike) -> TrainBatch:
        """Rows ``indices`` in that order (repeats allowed); media re-interned."""
        idx = _as_index(indices, len(self))
        kw: dict[str, Any] = {name: getattr(self, name)[idx] for name in _ROW_TENSORS}
        meta = [self.metadata[i] for i in idx.tolist()]
        return replace(
            self, **kw, media={k: v.select(idx) for k, v in self.media.items()}, metadata=tuple(meta)
        )

    def __getitem__(self, index: IndexLike) -> TrainBatch:
        return self.select(index)

    def repeat_interleave(self, repeats: int | torch.Tensor) -> TrainBatch:
        """Repeat each row ``repeats`` times (int or int64 ``[B]``); media rows share segments."""
        return self.select(_repeat_index(repeats, len(self)))

    def batch_advantages(self, mode: AdvantageMode, *, eps: float = 1e-6) -> TrainBatch:
        """A copy whose advantages use this whole batch as the baseline (``batch_norm`` / ``batch_mean``).

        One reward per sample (``sample_ids``; a multi-turn sample's rows share it), samples whose
        ``sample_mask`` is False left out of the mean and std and given 0, as in a group. A
        group whose rollouts all earned the same reward still gets a signal: its sign says
        whether that reward beat the batch's mean.
        """
        if mode not in BATCH_ADVANTAGE_MODES:
            raise ValueError(f"batch_advantages needs {sorted(BATCH_ADVANTAGE_MODES)}, not {mode!r}")
        if not len(self):
            return self
        samples, row_sample = torch.unique(self.sample_ids, return_inverse=True)
        first = torch.full((samples.numel(),), len(self), dtype=torch.int64)
        first.scatter_reduce_(0, row_sample, torch.arange(len(self)), reduce="amin")
        adv = group_advantages(
            self.rewards[first].to(torch.float64),
            samples.numel(),
            mode=mode,
            eps=eps,
            sample_mask=self.sample_mask[first],
        )
        return replace(self, advantages=adv[row_sample] * self.sample_mask.to(torch.float32))

    def trim(self) -> TrainBatch:
        """Drop trailing columns that are padding in every row."""
        length = int(self.lengths.max()) if len(self) else 0
        if length == self.seq_len:
            return self
        return replace(
            self,
            input_ids=self.input_ids[:, :length],
            attention_mask=self.attention_mask[:, :length],
            loss_mask=self.loss_mask[:, :length],
            logprobs=self.logprobs[:, :length],
        )

    @staticmethod
    def cat(batches: Sequence[TrainBatch], *, renumber: bool = False) -> TrainBatch:
        """Rows of ``batches`` one after another (padded to the longest); media re-interned by provenance.

        Ids are kept as they are by default (``cat`` of shards of one batch restores it).
        ``renumber=True`` offsets each part's ``group_ids`` and ``sample_ids`` past the
        previous parts' maxima, for joining separately built batches (e.g. one per group)
        whose ids all start at 0.
        """
        if not batches:
            raise ValueError("TrainBatch.cat needs at least one batch")
        if renumber:
            shifted: list[TrainBatch] = []
            next_group = next_sample = 0
            for b in batches:
                shifted.append(
                    replace(b, group_ids=b.group_ids + next_group, sample_ids=b.sample_ids + next_sample)
                )
                if len(b):
                    next_group += int(b.group_ids.max()) + 1
                    next_sample += int(b.sample_ids.max()) + 1
            batches = shifted
        length = max(b.seq_len for b in batches)
        pad_id = batches[0].pad_token_id
        keys = sorted({k for b in batches for k in b.media})
        pads = {"input_ids": pad_id, "attention_mask": 0, "loss_mask": 0.0, "logprobs": 0.0}
        kw: dict[str, Any] = {}
        for name in _ROW_TENSORS:
            parts = [getattr(b, name) for b in batches]
            if name in pads:
                parts = [_pad_cols(p, length, pads[name]) for p in parts]
            kw[name] = torch.cat(parts)
        # A part without key k gets empty rows with the other parts' pack_dim (cat refuses a mismatch).
        pack_dims = {k: next(b.media[k].pack_dim for b in batches if k in b.media) for k in keys}
        media = {
            k: PackedTensor.cat(
                [b.media[k] if k in b.media else PackedTensor.empty(len(b), pack_dims[k]) for b in batches]
            )
            for k in keys
        }
        meta = tuple(m for b in batches for m in b.metadata)
        return TrainBatch(**kw, media=media, metadata=meta, pad_token_id=pad_id)

    def shard(self, num_shards: int, *, group_aware: bool = True) -> list[TrainBatch]:
        """Split into ``num_shards`` DP shards balanced by **tokens** (``lengths``), not rows.

        A row's cost is its sequence tokens (what its forward and backward pass cost). With
        ``group_aware`` whole groups are the units: largest first, each onto the least loaded
        shard if that keeps the shard within ``target + max_row / 2`` (``target`` = total
        tokens / ``num_shards``); the groups that fit nowhere are split, their rows (in group
        order, so a split group stays on few shards) filling the least loaded shards up to one
        common water level at row boundaries. Without ``group_aware`` every row is its own unit.
        Every row lands in exactly one shard, in batch order inside it; each shard holds only
        the media segments its rows reference. A shard may be empty (fewer rows than shards).
        """
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        weights = [max(int(w), 1) for w in self.lengths.tolist()]
        if group_aware:
            by_group: dict[int, list[int]] = {}
            for row, gid in enumerate(self.group_ids.tolist()):
                by_group.setdefault(int(gid), []).append(row)
            units = list(by_group.values())
        else:
            units = [[row] for row in range(len(self))]
        assigned = _balance_units(units, weights, num_shards)
        return [self.select(torch.tensor(sorted(rows), dtype=torch.int64)) for rows in assigned]

    def micro_batches(self, max_tokens: int, *, packed: bool = False) -> list[TrainBatch]:
        """Dynamic batching: micro-batches of at most ``max_tokens`` tokens per forward pass.

        ``packed=False`` counts padded tokens (rows x longest row): rows are grouped longest
        first (similar lengths together, less padding). ``packed=True`` counts real tokens
        (the sum of the rows' lengths: the rows will be concatenated into one sequence, see
        :mod:`gymbridge.trainer.packing`) and fills the micro-batches first-fit decreasing.
        Either way, inside a micro-batch rows keep their batch order (their media, concatenated
        in that order, still line up with the placeholders) and padding is trimmed; micro-batches
        are ordered by their first row. Every row lands in exactly one micro-batch; a row longer
        than ``max_tokens`` gets a micro-batch of its own (logged) instead of failing the step.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        lengths = [int(n) for n in self.lengths.tolist()]
        over = [i for i, n in enumerate(lengths) if n > max_tokens]
        if over:
            logger.warning(
                "%d row(s) longer than the micro-batch budget of %d tokens (longest %d) run alone",
                len(over),
                max_tokens,
                max(lengths[i] for i in over),
            )
        if packed:
            bins = _first_fit_decreasing(lengths, max_tokens)
        else:
            bins = []
            longest = 0
            for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
                if bins and (len(bins[-1]) + 1) * longest <= max_tokens:
                    bins[-1].append(i)
                    continue
                bins.append([i])
                longest = max(lengths[i], 1)
        ordered = sorted((sorted(b) for b in bins), key=lambda b: b[0])
        return [self.select(b).trim() for b in ordered]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> TrainBatch:
        """A new batch on ``device`` (token tensors and media segments; media provenance kept)."""
        kw = {name: getattr(self, name).to(device, non_blocking=non_blocking) for name in _ROW_TENSORS}
        media = {k: v.to(device=device, non_blocking=non_blocking) for k, v in self.media.items()}
        return replace(self, **kw, media=media)

    def cast_media(self, dtype: torch.dtype) -> TrainBatch:
        """A new batch whose floating model inputs are cast to ``dtype`` (this one is unchanged).

        Which keys are cast is :data:`~gymbridge.tensors.processor.MEDIA_KEY_CAST`'s table
        (pixel values, audio features); metadata (grid sizes, masks, lengths, the video timing
        ``*_second_per_grid``) and keys the table does not list keep their dtype.
        """
        from gymbridge.tensors.processor import MEDIA_KEY_CAST

        media = {k: v.to(dtype=dtype) if MEDIA_KEY_CAST.get(k, False) else v for k, v in self.media.items()}
        return replace(self, media=media)

    def __repr__(self) -> str:
        media = ", ".join(
            f"{k}: {v.num_segments} segments/{v.num_refs} refs {v.dtype}" for k, v in self.media.items()
        )
        groups = int(torch.unique(self.group_ids).numel())
        return (
            f"TrainBatch(rows={len(self)}, seq_len={self.seq_len}, tokens={self.num_tokens}, "
            f"groups={groups}, media={{{media}}})"
        )

    # ------------------------------------------------------------------ pickling
    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        state = _dataclass_state(self, protocol.__index__())
        return (_rebuild_dataclass, (TrainBatch, state))


def _first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of row indices whose lengths sum to at most ``capacity`` (a longer row alone in its bin).

    Longest first (stable: equal lengths keep their order); each row goes into the first bin
    with room. Rows appear in a bin in the order they were placed (longest first).
    """
    room: list[int] = []
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        need = lengths[i]
        for b, free in enumerate(room):
            if free >= need:
                bins[b].append(i)
                room[b] -= need
                break
        else:
            bins.append([i])
            room.append(capacity - need)
    return bins


def _balance_units(units: Sequence[list[int]], weights: Sequence[int], num_shards: int) -> list[list[int]]:
    """Rows per shard (``TrainBatch.shard``): whole units where they fit, the rest water-filled."""
    total = sum(weights)
    target = total / num_shards
    slack = max(weights, default=0) / 2
    load = [0] * num_shards
    rows: list[list[int]] = [[] for _ in range(num_shards)]
    cost = [sum(weights[r] for r in unit) for unit in units]
    leftovers: list[int] = []
    for u in sorted(range(len(units)), key=lambda u: (-cost[u], u)):
        s = min(range(num_shards), key=lambda s: (load[s], s))
        if load[s] + cost[u] <= target + slack:
            rows[s].extend(units[u])
            load[s] += cost[u]
        else:
            leftovers.extend(units[u])
    if not leftovers:
        return rows
    # water level: the shards below it are filled up to it, in order of load, at row boundaries
    rest = sum(weights[r] for r in leftovers)
    order = sorted(range(num_shards), key=lambda s: (load[s], s))
    level = 0.0
    for k in range(1, num_shards + 1):
        level = (rest + sum(load[s] for s in order[:k])) / k
        if k == num_shards or level <= load[order[k]]:
            order = order[:k]
            break
    pos, filled, deficit = 0, 0, 0.0
    for i, s in enumerate(order):
        deficit += level - load[s]
        last = i == len(order) - 1
        # cut at the row boundary nearest to the cumulative deficit (the last shard takes the rest)
        while pos < len(leftovers) and (last or filled + weights[leftovers[pos]] / 2 <= deficit):
            rows[s].append(leftovers[pos])
            filled += weights[leftovers[pos]]
            load[s] += weights[leftovers[pos]]
            pos += 1
    return rows


def _dataclass_state(obj: Any, protocol: int) -> dict[str, Any]:
    """Field values with every tensor turned into an out-of-band payload."""
    state: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        state[f.name] = (
            ("tensor", _tensor_payload(value, protocol)) if isinstance(value, torch.Tensor) else value
        )
    return state


def _rebuild_dataclass(cls: type[Any], state: dict[str, Any]) -> Any:
    kw = {
        k: _rebuild_tensor(*v[1], writable=True)
        if isinstance(v, tuple) and len(v) == 2 and v[0] == "tensor"
        else v
        for k, v in state.items()
    }
    return cls(**kw)


def _check_placeholders(
    processor: MediaProcessor,
    traj_index: int,
    turn_index: int,
    item_index: int,
    prompt_token_ids: Sequence[int],
    media: Sequence[ProcessedMedia],
) -> None:
    """Each modality's placeholder tokens in the turn's prompt delta must equal what its media imply."""
    modalities = {m.modality for m in media} | {"image", "video", "audio"}
    tokens = torch.tensor(prompt_token_ids, dtype=torch.int64)
    for modality in sorted(modalities):
        token_id = processor.placeholder_token_id(modality)
        mine = [m for m in media if m.modality == modality]
        if token_id is None:
            if mine:
                logger.debug("no placeholder token known for %s; count check skipped", modality)
            continue
        expected_parts = [m.num_placeholders for m in mine]
        if any(p is None for p in expected_parts):
            continue
        expected = sum(p for p in expected_parts if p is not None)
        found = int((tokens == token_id).sum())
        if found != expected:
            raise TrajectoryError(
                f"trajectory {traj_index} turn {turn_index}: prompt holds {found} {modality} placeholder "
                f"token(s) but its {len(mine)} {modality}(s) need {expected} per the processor grid",
                item_index=item_index,
            )


def _content_keys_by_modality(media: Sequence[ProcessedMedia]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for m in media:
        out.setdefault(m.modality, []).append(m.content_key)
    return out


def _pack_media(rows: Sequence[Sequence[ProcessedMedia]], *, dedup: bool) -> dict[str, PackedTensor]:
    keys = sorted({k for row in rows for m in row for k in m.outputs})
    media: dict[str, PackedTensor] = {}
    for key in keys:
        tensors = [[m.outputs[key] for m in row if key in m.outputs] for row in rows]
        provs: list[Sequence[str | None]] = [
            [m.provenance[key] for m in row if key in m.outputs] for row in rows
        ]
        media[key] = PackedTensor.from_rows(tensors, provs, dedup=dedup)
    return media
