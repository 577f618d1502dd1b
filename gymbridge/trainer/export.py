"""Hugging Face export: a run's trained weights as a directory ``from_pretrained`` loads as is.

:func:`export_hf` writes, from one checkpoint of a run (``RUN_DIR/checkpoints/``, the newest or
``step``), a Hugging Face model directory: safetensors weights (``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json`` when they pass
``max_shard_size``), ``config.json``, ``generation_config.json`` and the processor / tokenizer /
chat template. What the export cannot know from the checkpoint (the model class, its config, the
processor) comes in a :class:`ModelParts`; ``gymbridge export`` builds it from the run's
``config.yaml`` (:mod:`gymbridge.run.cli`), a run's end from its own model.

The weights go through :func:`write_hf_weights`, whose input is an iterator of ``(name, full
tensor)`` pairs in the trainer's ``state_dict`` names: a ``.ckpt`` file
(:func:`checkpoint_tensors`) or a sharded checkpoint folder holding an ``index.json``
(``gymbridge.trainer.sharded_checkpoint.iter_full_tensors``, imported when one is met).

Invariants:

* the names written are the ones ``save_pretrained`` writes for the model class: tied aliases
  left out (``remove_tied_weights_from_state_dict``) and transformers' load-time renames undone
  (``revert_weight_conversion``: ``model.language_model.*`` -> ``model.*`` for Qwen2-VL), taken
  from a model built on the meta device (no weights allocated);
* at most one shard's tensors are held beyond the source: a ``.ckpt`` is checked (sha256, streamed)
  and then read tensor by tensor, only the policy's (``model.*``), never the optimizer's;
* a checkpoint that is corrupt, or whose weights do not fit the model (a name missing, unknown or
  of another shape), is a :class:`~gymbridge.errors.CheckpointError` naming the file; nothing is
  left at ``out_dir`` then: the export is written in a temporary sibling folder and renamed;
* floating-point tensors are cast to ``dtype`` (``config.json`` says it); integer ones are kept.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from gymbridge.errors import CheckpointError, ConfigError
from gymbridge.safe_io import verify_state
from gymbridge.trainer.checkpoint import FORMAT as CHECKPOINT_FORMAT

logger = logging.getLogger(__name__)

__all__ = [
    "EXPORT_DTYPES",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "ExportResult",
    "ModelParts",
    "ShardWritten",
    "WeightNames",
    "checkpoint_tensors",
    "export_hf",
    "find_checkpoint",
    "hf_weight_names",
    "parse_shard_size",
    "write_hf_weights",
]

EXPORT_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
"""The dtypes an export casts floating-point weights to."""

WEIGHTS_NAME = "model.safetensors"
"""The weights file when one shard holds them all (``from_pretrained``'s name)."""
INDEX_NAME = "model.safetensors.index.json"
"""The index of sharded weights (``weight_map``: tensor name -> file)."""
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf)$|.*\.index\.json$")
"""Files of a model directory that are weights (not copied with its processor files)."""


@dataclass(frozen=True)
class ModelParts:
    """What an export takes from the model rather than the checkpoint."""

    model_class: type[Any]
    """The ``transformers`` model class the trainer trained (``Qwen2VLForConditionalGeneration``)."""
    config: Any
    """Its ``PretrainedConfig`` (copied before the export sets ``dtype`` on it)."""
    generation_config: Any = None
    """Its ``GenerationConfig`` (``None``: none is written)."""
    processor: Any = None
    """The run's processor: a ``ProcessorMixin`` is saved with ``save_pretrained``; gymbridge's own
    tiny processors, which are not, have their tokenizer and image processor saved."""
    processor_dir: Path | None = None
    """A model directory whose processor / tokenizer / chat template files are copied instead."""


@dataclass(frozen=True)
class ShardWritten:
    """One weights file on disk (progress: :func:`write_hf_weights` reports each)."""

    index: int
    """1-based."""
    path: Path
    """Where it is now (its final name once the export completes)."""
    num_tensors: int
    num_bytes: int


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_hf` wrote."""

    out_dir: Path
    step: int
    checkpoint: Path
    dtype: str
    files: tuple[str, ...]
    """The weights files' names."""
    num_tensors: int
    num_bytes: int
    """Weights bytes (tensor data)."""
    elapsed_s: float = 0.0
    weight_map: dict[str, str] = field(default_factory=dict)


def parse_shard_size(value: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or ``"5GB"`` / ``"500MB"`` / ``"2GiB"`` as ``save_pretrained``
    reads it (GB = 10**9, GiB = 2**30); a bad or non-positive value is a :class:`ConfigError`."""
    if isinstance(value, int):
        size = value
    else:
        # huggingface_hub's own parser, the one save_pretrained's sharding uses
        from huggingface_hub.serialization._base import parse_size_to_int

        try:
            size = int(value) if value.strip().isdigit() else parse_size_to_int(value.strip())
        except ValueError as exc:
            raise ConfigError([f"max_shard_size {value!r}: {exc} (e.g. 5GB, 500MB, 2GiB)"]) from exc
    if size <= 0:
        raise ConfigError([f"max_shard_size {value!r}: must be more than 0 bytes"])
    return size


# ---------------------------------------------------------------------------- checkpoint sources
def find_checkpoint(source: str | Path, step: int | None = None) -> tuple[Path, int]:
    """``(checkpoint, step)`` of ``source``: a run directory, its ``checkpoints/`` folder, a ``.ckpt``
    file or a sharded checkpoint folder (``index.json``); the newest (``latest.json``) unless ``step``.

    A missing checkpoint is a :class:`CheckpointError` naming what was looked for.
    """
    from gymbridge.trainer.checkpoint import latest_step

    path = Path(source)
    if path.is_file() or (path / "index.json").is_file():
        if step is not None:
            raise ConfigError([f"{path} is one checkpoint: give its run directory to pick --step {step}"])
        match = re.search(r"step-(\d+)", path.name)
        return path, int(match.group(1)) if match else 0
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not root.is_dir():
        raise CheckpointError(path, "no such run directory or checkpoint")
    if step is None:
        step = latest_step(root)
        if step is None:
            raise CheckpointError(root / "latest.json", "no checkpoint here: the run wrote none yet")
    for candidate in (root / f"step-{step:06d}.ckpt", root / f"step-{step:06d}"):
        if candidate.is_file() or (candidate / "index.json").is_file():
            return candidate, step
    kept = sorted(p.name for p in root.glob("step-*"))
    raise CheckpointError(
        root / f"step-{step:06d}.ckpt", f"no checkpoint of step {step} (kept: {', '.join(kept) or 'none'})"
    )


def _verify_state_file(path: Path) -> None:
    """Check a run checkpoint file as :func:`gymbridge.safe_io.load_state` does, streamed
    (:func:`~gymbridge.safe_io.verify_state`), and that it is a run checkpoint."""
    meta = verify_state(path)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(path, f"not a {CHECKPOINT_FORMAT} file (format {meta.get('format')!r})")


def checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy weights of a checkpoint, ``(state_dict name, tensor)`` one at a time.

    A ``.ckpt`` file is verified first (sha256 over the whole file, streamed), then read with
    ``safetensors.safe_open`` tensor by tensor; a folder holding ``index.json`` is a sharded
    checkpoint, read with ``gymbridge.trainer.sharded_checkpoint.iter_full_tensors``. Only
    ``model.*`` tensors are yielded, without the prefix.
    """
    ckpt = Path(path)
    if (ckpt / "index.json").is_file():
        yield from _sharded_tensors(ckpt)
        return
    _verify_state_file(ckpt)
    from safetensors import safe_open

    try:
        with safe_open(str(ckpt), framework="pt") as f:
            names = [k for k in f.keys() if k.startswith("model.")]  # noqa: SIM118 - safe_open is no dict
            if not names:
                raise CheckpointError(ckpt, "holds no policy weights (model.*)")
            for name in names:
                yield name.removeprefix("model."), f.get_tensor(name)
    except CheckpointError:
        raise
    except Exception as exc:  # a checksummed-but-crafted file: parsing may raise anything
        raise CheckpointError(ckpt, f"malformed: {type(exc).__name__}: {exc}") from exc


def _sharded_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    import importlib

    try:
        sharded = importlib.import_module("gymbridge.trainer.sharded_checkpoint")
    except ModuleNotFoundError as exc:
        raise CheckpointError(
            folder, "a sharded checkpoint (index.json), but this gymbridge cannot read that format"
        ) from exc
    for name, tensor in sharded.iter_full_tensors(folder, prefix="model."):  # optimizer state never read
        yield name.removeprefix("model."), tensor


# ---------------------------------------------------------------------------- names and weights
def _meta_model(parts: ModelParts) -> Any:
    """``parts.model_class`` built on the meta device (names, shapes and ties; no storage)."""
    with torch.device("meta"):
        return parts.model_class(copy.deepcopy(parts.config))


WeightNames = dict[str, tuple[str, tuple[int, ...]] | None]
"""``state_dict`` name -> ``(name save_pretrained writes, shape)``; ``None``: a tied alias it leaves out."""


def hf_weight_names(model: Any) -> WeightNames:
    """:data:`WeightNames` of ``model``: every ``state_dict`` name, and what ``save_pretrained`` writes.

    Tied aliases map to ``None``; each load-time rename is undone, as ``save_pretrained`` does for
    a model ``from_pretrained`` loaded (it knows the model's conversions: Gemma 3's SigLIP tower is
    saved as ``vision_tower.vision_model.*``, the hub's and vLLM's names). Where those names would
    not load back to the same parameters (a conversion that only makes sense for a whole checkpoint
    of another class: the Omni thinker's ``thinker.`` prefix), the names of a model built from its
    config are written, which always do. A conversion that is not a rename (one tensor from several)
    is a ``NotImplementedError``: its tensors could not stream one by one.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
    saved = _reverted_names(model, kept, conversions)
    if conversions and not _loads_back(model, saved, conversions, state):
        saved = _reverted_names(model, kept, None)
    names: WeightNames = dict.fromkeys(state)
    for name, tensor in kept.items():
        names[name] = (saved[name], tuple(tensor.shape))
    return names


def _reverted_names(model: Any, kept: dict[str, torch.Tensor], conversions: Any) -> dict[str, str]:
    """``state_dict`` name -> saved name under ``conversions`` (``None``: those of a fresh model)."""
    from transformers.core_model_loading import revert_weight_conversion

    previous = getattr(model, "_weight_conversions", None)
    model._weight_conversions = conversions
    try:
        out: dict[str, str] = {}
        for name, tensor in kept.items():
            reverted = revert_weight_conversion(model, {name: tensor})
            if len(reverted) != 1:
                raise NotImplementedError(
                    f"{type(model).__name__}: {name} is saved as {sorted(reverted)}, not renamed; export "
                    "streams tensors one by one and supports renames only"
                )
            (out[name],) = reverted
        return out
    finally:
        model._weight_conversions = previous


def _loads_back(model: Any, saved: dict[str, str], conversions: Any, state: dict[str, Any]) -> bool:
    """Whether ``from_pretrained``'s renaming takes every saved name back to its parameter."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None)
    return all(
        rename_source_key(disk, renamings, converters, prefix, state)[0] == name
        for name, disk in saved.items()
    )


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def write_hf_weights(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    *,
    names: WeightNames,
    dtype: torch.dtype,
    max_shard_size: int | str = "5GB",
    source: str | Path = "<tensors>",
    on_shard: Callable[[ShardWritten], None] | None = None,
) -> ExportResult:
    """Write ``tensors`` (``state_dict`` names) as safetensors weights in ``out_dir``.

    ``names`` is :func:`hf_weight_names` of the model: each tensor is renamed, checked for shape,
    cast to ``dtype`` (floating point only) and added to the current shard; a shard is written as
    soon as the next tensor would take it past ``max_shard_size`` (a bigger tensor gets a shard of its
    own). One shard is ``model.safetensors``; several are renamed ``model-0000i-of-0000n.safetensors``
    once counted, with ``model.safetensors.index.json``. ``source`` names the checkpoint in errors.
    Returns the result with ``step`` 0 and ``checkpoint`` ``source`` (the caller knows better).
    """
    from safetensors.torch import save_file

    limit = parse_shard_size(max_shard_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    written: list[tuple[Path, list[str]]] = []
    seen: set[str] = set()
    total = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if not shard:
            return
        path = out / f".shard-{len(written) + 1:05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard)))
        info = ShardWritten(len(written), path, len(shard), shard_bytes)
        logger.debug(  # progress reaches a person through on_shard (the CLI prints each shard)
            "wrote weights shard %d: %d tensors, %.1f MiB", info.index, len(shard), shard_bytes / 2**20
        )
        if on_shard is not None:
            on_shard(info)
        shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        if name not in names:
            raise CheckpointError(source, f"weights do not fit this model: it has no {name}")
        if name in seen:
            raise CheckpointError(source, f"holds {name} twice")
        seen.add(name)
        target = names[name]
        if target is None:  # a tied alias: save_pretrained leaves it out
            continue
        saved, shape = target
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                source, f"weight {name} has shape {list(tensor.shape)}, the model {list(shape)}"
            )
        cast = dtype if tensor.is_floating_point() else tensor.dtype
        value = tensor.detach().to(device="cpu", dtype=cast, copy=True).contiguous()
        size = _tensor_bytes(value)
        if shard and shard_bytes + size > limit:
            flush()
        shard[saved] = value
        shard_bytes += size
        total += size
    missing = sorted(n for n, target in names.items() if target is not None and n not in seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(source, f"weights do not fit this model: {len(missing)} missing ({shown})")
    flush()
    weight_map: dict[str, str] = {}
    files: list[str] = []
    for i, (path, tensor_names) in enumerate(written, start=1):
        final = WEIGHTS_NAME if len(written) == 1 else f"model-{i:05d}-of-{len(written):05d}.safetensors"
        os.replace(path, out / final)
        files.append(final)
        weight_map.update(dict.fromkeys(tensor_names, final))
    if len(written) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return ExportResult(
        out,
        0,
        Path(source),
        str(dtype).removeprefix("torch."),
        tuple(files),
        len(weight_map),
        total,
        0.0,
        weight_map,
    )


# ---------------------------------------------------------------------------- the rest of the folder
def _save_processor(parts: ModelParts, out: Path) -> list[str]:
    """The processor / tokenizer / chat template files in ``out``; returns their names."""
    before = set(os.listdir(out))
    if parts.processor_dir is not None:
        for entry in sorted(Path(parts.processor_dir).iterdir()):
            if (
                entry.is_file()
                and not _WEIGHT_FILES.fullmatch(entry.name)
                and entry.name
                not in (
                    "config.json",
                    "generation_config.json",
                )
            ):
                shutil.copy2(entry, out / entry.name)
    elif parts.processor is not None:
        processor = parts.processor
        if callable(getattr(processor, "save_pretrained", None)):
            processor.save_pretrained(str(out))
        else:  # gymbridge's own tiny processor: its parts load back through HFGenerator.from_pretrained
            for attr in ("tokenizer", "image_processor"):
                part = getattr(processor, attr, None)
                if part is not None:
                    part.save_pretrained(str(out))
    return sorted(set(os.listdir(out)) - before)


def _write_config(parts: ModelParts, out: Path, dtype: str) -> None:
    config = copy.deepcopy(parts.config)
    config.architectures = [parts.model_class.__name__]
    config.dtype = dtype
    config.save_pretrained(str(out))
    if parts.generation_config is not None:
        copy.deepcopy(parts.generation_config).save_pretrained(str(out))


def _prepare_out(out_dir: Path, overwrite: bool) -> Path:
    """A fresh temporary sibling of ``out_dir`` to write in; refuses a non-empty ``out_dir``."""
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ConfigError([f"--out {out_dir}: is a file, not a directory"])
        if any(out_dir.iterdir()) and not overwrite:
            raise ConfigError(
                [f"--out {out_dir}: the directory is not empty; give a new one, or --overwrite to replace it"]
            )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.export-{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def export_hf(
    source: str | Path,
    out_dir: str | Path,
    *,
    parts: ModelParts,
    step: int | None = None,
    dtype: str = "float32",
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    on_shard: Callable[[ShardWritten], None] | None = None,
) -> ExportResult:
    """Write the Hugging Face directory of ``source``'s checkpoint (module docstring) at ``out_dir``.

    ``source``: a run directory, its ``checkpoints/`` folder or one checkpoint (:func:`find_checkpoint`);
    ``dtype``: one of :data:`EXPORT_DTYPES`. ``out_dir`` must be absent or empty unless ``overwrite``
    (then it is replaced once the new export is complete).
    """
    import time

    started = time.perf_counter()
    if dtype not in EXPORT_DTYPES:
        raise ConfigError([f"dtype {dtype!r}: one of {', '.join(EXPORT_DTYPES)}"])
    limit = parse_shard_size(max_shard_size)
    ckpt, found_step = find_checkpoint(source, step)
    out = Path(out_dir)
    tmp = _prepare_out(out, overwrite)
    try:
        names = hf_weight_names(_meta_model(parts))
        result = write_hf_weights(
            checkpoint_tensors(ckpt),
            tmp,
            names=names,
            dtype=EXPORT_DTYPES[dtype],
            max_shard_size=limit,
            source=ckpt,
            on_shard=on_shard,
        )
        _write_config(parts, tmp, dtype)
        _save_processor(parts, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise
    elapsed = time.perf_counter() - started
    logger.debug("exported step %d of %s to %s (%.1f s)", found_step, ckpt, out, elapsed)
    return replace(result, out_dir=out, step=found_step, checkpoint=ckpt, dtype=dtype, elapsed_s=elapsed)
