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

**LoRA.** A LoRA run's checkpoint holds only what training changed (its metadata's ``"lora"``:
:func:`checkpoint_lora`): the adapters under their in-model names and, with ``vision: full``, the
encoders' full tensors (:func:`gymbridge.generation.lora.published_names`). :func:`export_adapter`
writes it as a peft adapter directory (``PeftModel.from_pretrained``; encoders trained in full as
peft's ``modules_to_save``); :func:`export_hf` merges it into the base weights
(``ModelParts.base_weights``, streamed: ``W + (alpha / r) * B @ A`` per adapted layer, one base
tensor at a time) and writes the same directory as a full fine-tuning run's; :func:`export_run` is
what ``gymbridge export`` and a run's end write (the adapter, or with ``merge`` the merged model
and the adapter in ``adapter/``). The checkpoint is checked against the adapters its settings give
the model (peft injected into the meta-device model) before anything is written.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from gymbridge.errors import CheckpointError, ConfigError
from gymbridge.generation.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_file_name,
    apply_lora,
    is_adapter_name,
    published_names,
    write_adapter_dir,
)
from gymbridge.safe_io import verify_state
from gymbridge.trainer.checkpoint import FORMAT as CHECKPOINT_FORMAT
from gymbridge.trainer.memory import ENCODER_NAMES

logger = logging.getLogger(__name__)

__all__ = [
    "ADAPTER_DIR",
    "EXPORT_DTYPES",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "ExportKind",
    "ExportResult",
    "ModelParts",
    "ShardWritten",
    "WeightNames",
    "base_name",
    "checkpoint_lora",
    "checkpoint_meta",
    "checkpoint_tensors",
    "export_adapter",
    "export_hf",
    "export_run",
    "find_checkpoint",
    "hf_weight_names",
    "merge_lora_weight",
    "model_dir_weights",
    "module_weights",
    "parse_shard_size",
    "write_hf_weights",
]

EXPORT_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
"""The dtypes an export casts floating-point weights to."""

WEIGHTS_NAME = "model.safetensors"
"""The weights file when one shard holds them all (``from_pretrained``'s name)."""
INDEX_NAME = "model.safetensors.index.json"
"""The index of sharded weights (``weight_map``: tensor name -> file)."""
ADAPTER_DIR = "adapter"
"""Where a merged LoRA export (:func:`export_run` with ``merge``) puts the adapter, inside the model."""
ExportKind = Literal["full", "adapter", "merged"]
"""What an export wrote: a full fine-tuning run's model, a LoRA adapter, or LoRA merged into its base."""
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
    base_weights: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None
    """The base model's weights, for merging a LoRA checkpoint (which holds only what training
    changed): called once per export, it yields ``(state_dict name, tensor)`` one at a time
    (:func:`module_weights` of a model in memory, :func:`model_dir_weights` of a model directory).
    ``None``: a LoRA checkpoint can be exported as an adapter only."""
    base_model: str | None = None
    """What a LoRA adapter's ``base_model_name_or_path`` says: the run's model source."""

    @classmethod
    def of_model(cls, model: Any, processor: Any, *, base_model: str | None = None) -> ModelParts:
        """The parts of ``model`` in memory (a run's policy, LoRA adapters injected or not), its own
        weights as the base (:func:`module_weights`: a LoRA model's frozen base layers)."""
        return cls(
            type(model),
            model.config,
            getattr(model, "generation_config", None),
            processor,
            base_weights=functools.partial(module_weights, model),
            base_model=base_model,
        )


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
    kind: ExportKind = "full"
    adapter_dir: Path | None = None
    """Where the LoRA adapter directory is (``kind`` ``adapter``: ``out_dir``; ``merged`` by
    :func:`export_run`: ``out_dir / adapter``); ``None`` when none was written."""

    @property
    def what(self) -> str:
        """What was written, for a person (``"a Hugging Face model"``, ...)."""
        if self.kind == "adapter":
            return "a LoRA adapter (peft)"
        if self.kind == "merged":
            inside = f", the adapter in {ADAPTER_DIR}/" if self.adapter_dir is not None else ""
            return f"a Hugging Face model (LoRA merged{inside})"
        return "a Hugging Face model"


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


def _verify_state_file(path: Path) -> dict[str, Any]:
    """Check a run checkpoint file as :func:`gymbridge.safe_io.load_state` does, streamed
    (:func:`~gymbridge.safe_io.verify_state`), and that it is a run checkpoint; returns its meta."""
    meta = verify_state(path)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(path, f"not a {CHECKPOINT_FORMAT} file (format {meta.get('format')!r})")
    return meta


def checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """The JSON metadata of a checkpoint, after its checks: a ``.ckpt`` file's (sha256 over the whole
    file, streamed; a run checkpoint's format), or a sharded folder's ``index.json`` meta (every
    index checked: ``gymbridge.trainer.sharded_checkpoint.read_meta``). Raises
    :class:`CheckpointError` for anything unusable; the tensors are not read."""
    ckpt = Path(path)
    if (ckpt / "index.json").is_file():
        meta: dict[str, Any] = _sharded_module(ckpt).read_meta(ckpt)
        return meta
    return _verify_state_file(ckpt)


def checkpoint_lora(path: str | Path) -> dict[str, Any] | None:
    """The LoRA settings a checkpoint was saved with (its metadata's ``"lora"``, as
    :func:`gymbridge.generation.lora.lora_settings` gives them: ``r``, ``lora_alpha``, ``lora_dropout``,
    ``target_modules``, ``bias``, ``vision``), ``None`` for a full fine-tuning checkpoint. The
    checkpoint is checked as :func:`checkpoint_meta` does; malformed settings are a
    :class:`CheckpointError`."""
    return _lora_of(Path(path), checkpoint_meta(path))


def _lora_of(path: Path, meta: dict[str, Any]) -> dict[str, Any] | None:
    raw = meta.get("lora")
    if raw is None:
        return None
    try:
        if not isinstance(raw, dict):
            raise TypeError(f"a {type(raw).__name__}, not an object")
        rank, alpha = raw["r"], float(raw["lora_alpha"])
        if type(rank) is not int or rank < 1:
            raise ValueError(f"r {rank!r} is not a positive int")
        if not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"lora_alpha {alpha!r} is not positive")
        dropout = float(raw.get("lora_dropout", 0.0))
        target = raw["target_modules"]
        if not isinstance(target, str):
            raise TypeError(f"target_modules is a {type(target).__name__}, not a pattern string")
        re.compile(target)
        vision = raw.get("vision", "frozen")
        if vision not in ("frozen", "full"):
            raise ValueError(f"vision {vision!r} is not frozen or full")
        if raw.get("bias", "none") != "none":
            raise ValueError(f"bias {raw.get('bias')!r}: only 'none' is trained")
        in_full = raw.get("full_modules") or []
        if not isinstance(in_full, list) or not all(isinstance(m, str) for m in in_full):
            raise TypeError("full_modules is not a list of module names")
    except (KeyError, TypeError, ValueError, re.error) as exc:
        raise CheckpointError(path, f"malformed LoRA settings: {type(exc).__name__}: {exc}") from exc
    return {
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": target,
        "bias": "none",
        "vision": vision,
        "full_modules": list(in_full),
    }


def checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy weights of a checkpoint, ``(state_dict name, tensor)`` one at a time.

    A ``.ckpt`` file is verified first (sha256 over the whole file, streamed), then read with
    ``safetensors.safe_open`` tensor by tensor; a folder holding ``index.json`` is a sharded
    checkpoint, read with ``gymbridge.trainer.sharded_checkpoint.iter_full_tensors``. Only
    ``model.*`` tensors are yielded, without the prefix (a LoRA checkpoint's: the adapters and the
    tensors trained in full, under their in-model names).
    """
    ckpt = Path(path)
    if not (ckpt / "index.json").is_file():
        _verify_state_file(ckpt)
    yield from _verified_tensors(ckpt)


def _verified_tensors(ckpt: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`checkpoint_tensors` of a checkpoint whose file was verified already."""
    if (ckpt / "index.json").is_file():
        yield from _sharded_tensors(ckpt)
        return
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


def _sharded_module(folder: Path) -> Any:
    import importlib

    try:
        return importlib.import_module("gymbridge.trainer.sharded_checkpoint")
    except ModuleNotFoundError as exc:
        raise CheckpointError(
            folder, "a sharded checkpoint (index.json), but this gymbridge cannot read that format"
        ) from exc


def _sharded_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    sharded = _sharded_module(folder)
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


# ---------------------------------------------------------------------------- base weights (LoRA)
_BASE_LAYER = re.compile(r"\.base_layer(?=\.[^.]+$)")


def base_name(name: str) -> str:
    """A LoRA model's ``state_dict`` name as its base model spells it
    (``x.q_proj.base_layer.weight`` -> ``x.q_proj.weight``); other names unchanged."""
    return _BASE_LAYER.sub("", name)


def module_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s weights under its base model's ``state_dict`` names, one at a time: a LoRA
    model's adapters left out and its ``.base_layer.`` names restored (the frozen base a merge
    adds the adapters to; for a model without adapters, its ``state_dict``)."""
    for name, tensor in model.state_dict().items():
        if not is_adapter_name(name):
            yield base_name(name), tensor


def model_dir_weights(
    folder: str | Path, model_class: type[Any], config: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of the Hugging Face model directory ``folder``, read one tensor at a time
    (``safetensors.safe_open``), under ``model_class``'s ``state_dict`` names.

    The files are ``model.safetensors`` or those ``model.safetensors.index.json`` names (never
    pickles); each name gets the renames ``from_pretrained`` applies when it loads them (hub
    Qwen2-VL's ``model.layers.*`` -> ``model.language_model.layers.*``), and names the model does not
    have are skipped, as ``from_pretrained`` does. A conversion that is not a rename is a
    ``NotImplementedError``; an unreadable file a :class:`CheckpointError` naming it.
    """
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    root = Path(folder)
    files = _weight_files(root)
    model = _meta_model(ModelParts(model_class, config))
    state = model.state_dict()
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None)
    for file in files:
        path = root / file
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is no dict
                    name, converter = rename_source_key(key, renamings, converters, prefix, state)
                    if converter is not None:
                        raise NotImplementedError(
                            f"{model_class.__name__}: {key} in {path} is converted, not renamed, on "
                            "load; a LoRA merge streams base tensors one by one and supports renames only"
                        )
                    if name not in state:
                        logger.debug(
                            "base weights: %s in %s is not a weight of the model; skipped", key, path
                        )
                        continue
                    yield name, f.get_tensor(key)
        except (CheckpointError, NotImplementedError):
            raise
        except Exception as exc:  # safetensors' own errors: a truncated or foreign file
            raise CheckpointError(path, f"unreadable base weights: {type(exc).__name__}: {exc}") from exc


def _weight_files(root: Path) -> list[str]:
    """The safetensors files of a model directory, in the order of its index (or the one file)."""
    index = root / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = list(dict.fromkeys(weight_map.values()))
            if not all(
                isinstance(f, str) and Path(f).name == f and f.endswith(".safetensors") for f in files
            ):
                raise ValueError("weight_map names something other than .safetensors files beside it")
        except (OSError, KeyError, TypeError, AttributeError, ValueError) as exc:
            raise CheckpointError(index, f"malformed: {type(exc).__name__}: {exc}") from exc
        return files
    if (root / WEIGHTS_NAME).is_file():
        return [WEIGHTS_NAME]
    raise CheckpointError(
        root,
        f"no {WEIGHTS_NAME} or {INDEX_NAME}: the base weights of a LoRA merge are read from safetensors only",
    )


def merge_lora_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """``weight + scale * lora_b @ lora_a`` in float32 on the CPU (``[out, in]``, ``[r, in]``,
    ``[out, r]``; ``scale`` = ``lora_alpha / r``): what peft's ``merge_and_unload`` computes for an
    ``nn.Linear`` adapter without ``fan_in_fan_out``."""
    merged = weight.detach().to(device="cpu", dtype=torch.float32, copy=True)
    merged.addmm_(
        lora_b.detach().to("cpu", torch.float32), lora_a.detach().to("cpu", torch.float32), alpha=scale
    )
    return merged


@dataclass(frozen=True)
class _LoRAPlan:
    """What a LoRA checkpoint must hold for a model, and how it merges (:func:`_lora_plan`)."""

    settings: dict[str, Any]
    names: WeightNames
    """The base model's (:func:`hf_weight_names`): what a merged export writes."""
    published: dict[str, tuple[int, ...]]
    """The LoRA model's trained tensors (adapters, encoders trained in full) -> shape."""
    adapted: dict[str, tuple[str, str]]
    """Base weight name of each adapted ``nn.Linear`` -> the names of its ``lora_A`` and ``lora_B``."""
    unmergeable: tuple[str, ...]
    """Why some adapters cannot be merged (not on an ``nn.Linear``, or on a tied weight)."""

    @property
    def scale(self) -> float:
        return float(self.settings["lora_alpha"]) / int(self.settings["r"])

    def describe(self) -> str:
        return f"r={self.settings['r']}, vision={self.settings['vision']}"


def _lora_plan(parts: ModelParts, ckpt: Path, settings: dict[str, Any]) -> _LoRAPlan:
    """The adapters ``settings`` give ``parts``'s model, from peft injected into its meta-device copy;
    settings that fit no layer of it are a :class:`CheckpointError`."""
    model = _meta_model(parts)
    names = hf_weight_names(model)
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    tied = {name for group in aliases.values() if len(group) > 1 for name in group}
    try:
        apply_lora(model, settings)  # settings["vision"]: encoders trained in full or not
    except ValueError as exc:
        raise CheckpointError(ckpt, f"its LoRA settings do not fit {type(model).__name__}: {exc}") from exc
    from peft.tuners.lora import Linear as LoRALinear  # apply_lora names the extra when peft is missing
    from peft.tuners.lora import LoraLayer

    state = model.state_dict()
    published = {name: tuple(state[name].shape) for name in sorted(published_names(model) or ())}
    adapted: dict[str, tuple[str, str]] = {}
    unmergeable: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module, LoRALinear):
            unmergeable.append(f"{name} is a {type(module).__name__}, not an nn.Linear adapter")
            continue
        weight = f"{name}.weight"
        if weight in tied:
            unmergeable.append(f"{weight} is tied to another weight; merging would untie them")
            continue
        adapted[weight] = (f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight")
    return _LoRAPlan(dict(settings), names, published, adapted, tuple(unmergeable))


def _checked_lora(ckpt: Path, plan: _LoRAPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a LoRA checkpoint (verified already), each checked against ``plan``; what is
    unknown, of another shape or missing is a :class:`CheckpointError` naming the checkpoint."""
    seen: set[str] = set()
    for name, tensor in _verified_tensors(ckpt):
        shape = plan.published.get(name)
        if shape is None:
            raise CheckpointError(
                ckpt, f"weights do not fit this model's LoRA adapters ({plan.describe()}): it has no {name}"
            )
        if name in seen:
            raise CheckpointError(ckpt, f"holds {name} twice")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                ckpt,
                f"LoRA weight {name} has shape {list(tensor.shape)}, this model's adapters "
                f"({plan.describe()}) {list(shape)}",
            )
        seen.add(name)
        yield name, tensor
    missing = sorted(set(plan.published) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(
            ckpt,
            f"weights do not fit this model's LoRA adapters ({plan.describe()}): "
            f"{len(missing)} missing ({shown})",
        )


def _owner(name: str) -> str:
    """The module a tensor trained in full is saved with as peft's ``modules_to_save``: its outermost
    encoder (``model.visual``), else the module holding it."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ENCODER_NAMES:
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1])


def _merged_tensors(
    ckpt: Path, plan: _LoRAPlan, base: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged model's weights (``state_dict`` names): first the checkpoint's tensors trained in
    full as they stream (its adapters kept aside: they are small), then every base tensor, with
    ``(alpha / r) * B @ A`` added to each adapted one."""
    adapters: dict[str, torch.Tensor] = {}
    in_full: set[str] = set()
    for name, tensor in _checked_lora(ckpt, plan):
        if is_adapter_name(name):
            adapters[name] = tensor
        else:
            in_full.add(name)
            yield name, tensor
    for raw_name, tensor in base:
        if is_adapter_name(raw_name):
            continue
        name = base_name(raw_name)
        if name in in_full:
            continue
        pair = plan.adapted.get(name)
        if pair is not None:
            tensor = merge_lora_weight(tensor, adapters[pair[0]], adapters[pair[1]], plan.scale)
        yield name, tensor


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


def _check_out(out_dir: Path, overwrite: bool) -> None:
    """Refuse an ``out_dir`` that is a file, or a non-empty directory unless ``overwrite``."""
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ConfigError([f"--out {out_dir}: is a file, not a directory"])
        if any(out_dir.iterdir()) and not overwrite:
            raise ConfigError(
                [f"--out {out_dir}: the directory is not empty; give a new one, or --overwrite to replace it"]
            )


@contextlib.contextmanager
def _staged(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """A fresh temporary sibling of ``out_dir`` to write in, renamed to ``out_dir`` when the block
    completes (replacing it) and removed when it raises: nothing is left at ``out_dir`` then."""
    _check_out(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.export-{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise


def _write_adapter(
    ckpt: Path, plan: _LoRAPlan, parts: ModelParts, out: Path, dtype: str
) -> tuple[int, int, tuple[str, ...]]:
    """The peft adapter directory of a LoRA checkpoint in ``out``: ``(tensors, bytes, full modules)``.

    Adapters are renamed to peft's file names (:func:`~gymbridge.generation.lora.adapter_file_name`);
    tensors trained in full (``vision: full``, ``full_modules``) are written as peft writes
    ``modules_to_save`` (``base_model.model.<name>``) and their modules listed in ``adapter_config.json``.
    """
    cast = EXPORT_DTYPES[dtype]
    tensors: dict[str, torch.Tensor] = {}
    full: set[str] = set()
    for name, tensor in _checked_lora(ckpt, plan):
        value = tensor.detach().to(device="cpu", dtype=cast if tensor.is_floating_point() else tensor.dtype)
        if is_adapter_name(name):
            tensors[adapter_file_name(name)] = value
        else:
            tensors[f"base_model.model.{name}"] = value
            full.add(_owner(name))
    write_adapter_dir(out, tensors, plan.settings, base_model=parts.base_model)
    if full:
        config_path = out / ADAPTER_CONFIG
        config = json.loads(config_path.read_text())
        config["modules_to_save"] = sorted(full)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _save_processor(parts, out)
    return len(tensors), sum(_tensor_bytes(t) for t in tensors.values()), tuple(sorted(full))


def _export(
    source: str | Path,
    out_dir: str | Path,
    *,
    parts: ModelParts,
    step: int | None,
    dtype: str,
    max_shard_size: int | str,
    overwrite: bool,
    on_shard: Callable[[ShardWritten], None] | None,
    lora: Literal["merged", "adapter", "both"],
    full: bool,
) -> ExportResult:
    """The one export path: a full fine-tuning checkpoint's model (``full``: else refused), or what
    ``lora`` says of a LoRA checkpoint: the merged model, the adapter, or both (the adapter then in
    :data:`ADAPTER_DIR` inside the model)."""
    started = time.perf_counter()
    if dtype not in EXPORT_DTYPES:
        raise ConfigError([f"dtype {dtype!r}: one of {', '.join(EXPORT_DTYPES)}"])
    limit = parse_shard_size(max_shard_size)
    ckpt, found_step = find_checkpoint(source, step)
    out = Path(out_dir)
    _check_out(out, overwrite)  # before the checkpoint's checksum pass, which reads the whole file
    settings = _lora_of(ckpt, checkpoint_meta(ckpt))
    plan: _LoRAPlan | None = None
    model = settings is None or lora != "adapter"
    adapter = settings is not None and lora != "merged"
    if settings is None:
        if not full:
            raise ConfigError([f"{ckpt}: a full fine-tuning checkpoint (no LoRA adapters); export the model"])
    else:
        plan = _lora_plan(parts, ckpt, settings)  # settings that do not fit: refused before any write
        if model and parts.base_weights is None:
            raise ConfigError(
                [f"{ckpt}: a LoRA checkpoint holds no base weights; merging needs ModelParts.base_weights"]
            )
        if model and plan.unmergeable:
            raise NotImplementedError(
                f"cannot merge the LoRA adapters of {ckpt}: {'; '.join(plan.unmergeable)}"
            )
    with _staged(out, overwrite) as tmp:
        result = ExportResult(tmp, found_step, ckpt, dtype, (), 0, 0)
        if model:
            if plan is None:
                tensors: Iterable[tuple[str, torch.Tensor]] = _verified_tensors(ckpt)
                names = hf_weight_names(_meta_model(parts))
            else:
                assert parts.base_weights is not None
                tensors, names = _merged_tensors(ckpt, plan, parts.base_weights()), plan.names
            result = write_hf_weights(
                tensors,
                tmp,
                names=names,
                dtype=EXPORT_DTYPES[dtype],
                max_shard_size=limit,
                source=ckpt,
                on_shard=on_shard,
            )
            _write_config(parts, tmp, dtype)
            _save_processor(parts, tmp)
        adapter_dir: Path | None = None
        if plan is not None and adapter:
            adapter_dir = out / ADAPTER_DIR if model else out
            count, size, _ = _write_adapter(ckpt, plan, parts, tmp / ADAPTER_DIR if model else tmp, dtype)
            if not model:
                result = replace(
                    result,
                    files=(ADAPTER_WEIGHTS,),
                    num_tensors=count,
                    num_bytes=size,
                    weight_map={},
                )
    elapsed = time.perf_counter() - started
    kind: ExportKind = "full" if plan is None else ("merged" if model else "adapter")
    logger.debug("exported step %d of %s to %s as %s (%.1f s)", found_step, ckpt, out, kind, elapsed)
    return replace(
        result,
        out_dir=out,
        step=found_step,
        checkpoint=ckpt,
        dtype=dtype,
        elapsed_s=elapsed,
        kind=kind,
        adapter_dir=adapter_dir,
    )


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
    (then it is replaced once the new export is complete). A LoRA checkpoint is merged into
    ``parts.base_weights`` (``ConfigError`` without them); its adapter is not written
    (:func:`export_run`, :func:`export_adapter`).
    """
    return _export(
        source,
        out_dir,
        parts=parts,
        step=step,
        dtype=dtype,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        on_shard=on_shard,
        lora="merged",
        full=True,
    )


def export_adapter(
    source: str | Path,
    out_dir: str | Path,
    *,
    parts: ModelParts,
    step: int | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
) -> ExportResult:
    """Write the peft adapter directory of ``source``'s LoRA checkpoint at ``out_dir``:
    ``adapter_config.json`` (``base_model_name_or_path`` = ``parts.base_model``),
    ``adapter_model.safetensors`` and the processor / tokenizer / chat template files.

    ``PeftModel.from_pretrained(base, out_dir)`` loads it onto the run's base model. Floating-point
    tensors are cast to ``dtype``. A full fine-tuning checkpoint is a ``ConfigError``; settings or
    tensors that do not fit ``parts``'s model a :class:`CheckpointError`.
    """
    return _export(
        source,
        out_dir,
        parts=parts,
        step=step,
        dtype=dtype,
        max_shard_size="5GB",
        overwrite=overwrite,
        on_shard=None,
        lora="adapter",
        full=False,
    )


def export_run(
    source: str | Path,
    out_dir: str | Path,
    *,
    parts: ModelParts,
    step: int | None = None,
    dtype: str = "float32",
    max_shard_size: int | str = "5GB",
    merge: bool = False,
    overwrite: bool = False,
    on_shard: Callable[[ShardWritten], None] | None = None,
) -> ExportResult:
    """What ``gymbridge export`` and a run's end (``output.export: final``) write (docs/export.md).

    A full fine-tuning checkpoint: the Hugging Face model (:func:`export_hf`; ``merge`` changes
    nothing). A LoRA checkpoint: the peft adapter directory at ``out_dir`` (:func:`export_adapter`);
    with ``merge``, the merged Hugging Face model at ``out_dir`` (:func:`export_hf`) and the adapter
    in ``out_dir/adapter/``, written together (both, or nothing at ``out_dir``).
    """
    return _export(
        source,
        out_dir,
        parts=parts,
        step=step,
        dtype=dtype,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        on_shard=on_shard,
        lora="both" if merge else "adapter",
        full=True,
    )
