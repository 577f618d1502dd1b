"""``VLLMGenerator``: the vLLM backend (GPU; the ``vllm`` extra), token in / token out.

Each :class:`~gymbridge.trajectory.types.GenerationInput` becomes one ``TokensPrompt`` carrying
**all** media of the conversation so far and a ``SamplingParams`` asking for the sampled token's
logprob; the engine is vLLM's ``AsyncLLM`` with ``logprobs_mode="processed_logprobs"``, so reported
logprobs are those of the distribution sampled from, like
:class:`~gymbridge.generation.hf.HFGenerator`'s. :class:`VLLMWeightSink` receives a trainer's
broadcast weights (the model server's ``/weights/*`` routes).

Invariants:

* ``vllm`` is imported lazily; a missing vLLM raises ``ImportError`` naming the extra;
* :meth:`VLLMGenerator.build_request` is pure and is what :meth:`generate` sends; it cuts each
  media item's expanded placeholders back to the one vLLM expands itself (the family's
  :meth:`~gymbridge.families.ModelFamily.vllm_prompt`), and :func:`generation_from_output` checks
  the prompt vLLM ran against the recorded one token for token (else
  :class:`VLLMGenerationError` names the first difference): a placeholder mismatch never reaches
  training;
* media placeholder and vision boundary ids are never sampled (``logit_bias = {id: -inf}`` on
  every request, before temperature / top-p);
* a weight swap (:meth:`VLLMGenerator.swap_weights`) pauses the engine, loads through the model's
  own ``load_weights``, resets the prefix and encoder caches (a refused reset raises
  :class:`~gymbridge.errors.WeightSyncError`) and resumes: no KV block or encoder output of the old
  weights is reused; a request records the version current when it was submitted;
* audio reaches vLLM mono at the feature extractor's rate, so both count the same placeholders;
* with a LoRA trainer (:meth:`VLLMGenerator.prepare_lora`) the base weights never travel: each
  version's adapter tensors are written as a peft adapter directory and registered with vLLM's own
  LoRA path (``add_lora``, a new ``LoRARequest`` id per version), full tensors (``vision: full``)
  load through ``load_weights`` (and only they make the swap reset the caches: vLLM keys KV blocks
  by adapter); every request submitted after the swap carries the version's ``LoRARequest`` (until
  the first adapter the engine serves the base), and an older adapter and its directory are
  removed once no request carries it;
* full weights from a trainer reach the workers through vLLM's own weight-transfer protocol where
  the installed vLLM ships it (``vllm.distributed.weight_transfer``, detected by import:
  :func:`weight_transfer_available`): :meth:`VLLMWeightSink.vllm_transfer` drives the engine's
  ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update`` inside a weight swap, with vLLM's NCCL engine (packed broadcast; the
  trainer on other GPUs) or its CUDA IPC engine (the trainer on the workers' GPU), chosen per
  trainer at the handshake. gymbridge's own buckets through ``collective_rpc`` remain for LoRA
  adapters and for vLLM releases without that module. The trainer's side:
  :mod:`gymbridge.trainer.vllm_transfer`.

The tested vLLM version, the names used and the swap policy in detail: docs/generation.md, "vLLM,
checked against the real package".
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gymbridge.errors import GymbridgeError, WeightSyncError
from gymbridge.generation.types import (
    FinishReason,
    Generation,
    SamplingConfig,
    fit_max_tokens,
    media_special_token_ids,
    row_seeds,
)
from gymbridge.trajectory.types import GenerationInput

logger = logging.getLogger(__name__)

__all__ = [
    "SUBMODEL_PREFIXES",
    "TRANSFER_BACKENDS",
    "VLLM_TRANSPORT",
    "VLLMGenerationError",
    "VLLMGenerator",
    "VLLMWeightSink",
    "WeightSyncWorkerExtension",
    "audio_for_vllm",
    "checkpoint_name",
    "collapse_placeholders",
    "decode_ipc_handle",
    "encode_ipc_handle",
    "generation_from_output",
    "import_vllm",
    "lora_layout_problems",
    "placeholder_token_ids",
    "weight_transfer_available",
]

_EXTENSION_PATH = "gymbridge.generation.vllm.WeightSyncWorkerExtension"

VLLM_TRANSPORT = "vllm"
"""The ``transport`` of ``/weights/*`` calls that speak vLLM's own weight-transfer protocol."""
TRANSFER_BACKENDS: tuple[str, ...] = ("nccl", "ipc")
"""vLLM weight-transfer engines gymbridge drives: NCCL (packed broadcast, separate GPUs) and CUDA IPC
(the trainer on the workers' GPU)."""


class VLLMGenerationError(GymbridgeError):
    """vLLM returned an output gymbridge cannot use (aborted request, missing logprobs)."""


def import_vllm() -> Any:
    """Import vLLM or raise an ``ImportError`` that names the extra to install."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            "VLLMGenerator needs vLLM, which is not installed: install the extra with "
            "`pip install 'gymbridge[vllm]'` (GPU machines only)"
        ) from exc
    return vllm


def weight_transfer_available() -> bool:
    """Whether the installed vLLM ships its trainer-to-engine weight-transfer protocol
    (``vllm.distributed.weight_transfer``: the request types ``AsyncLLM`` takes and the engine
    factory the workers build from). Detected by import, not by version: without it (or without
    vLLM) weights travel as gymbridge's own buckets through ``collective_rpc``."""
    try:
        from vllm.distributed.weight_transfer.base import (  # noqa: F401
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: F401
    except ImportError:
        return False
    return True


_IPC_FIELDS: tuple[str, ...] = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
"""The arguments of ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, in order: what
``reduce_tensor`` returns for a CUDA tensor and what vLLM's IPC engine rebuilds each weight from
(it overwrites ``storage_device``, index 6, with the receiving worker's)."""
_IPC_BYTES = frozenset({"storage_handle", "ref_counter_handle", "event_handle"})
_IPC_BOOLS = frozenset({"requires_grad", "event_sync_required"})


def encode_ipc_handle(args: Sequence[Any]) -> dict[str, Any]:
    """One CUDA IPC handle (``reduce_tensor(t)[1]``) as JSON: classes and the dtype by name, bytes
    in base64. vLLM's own HTTP client pickles the handles instead, which its workers then unpickle
    only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; this form needs neither (:func:`decode_ipc_handle`)."""
    import torch

    classes = _ipc_classes()
    if len(args) != len(_IPC_FIELDS):
        raise ValueError(f"a CUDA IPC handle has {len(_IPC_FIELDS)} fields, got {len(args)}")
    out: dict[str, Any] = {}
    for field, value in zip(_IPC_FIELDS, args, strict=True):
        if field in classes:
            names = [name for name, cls in classes[field].items() if cls is value]
            if not names:
                raise ValueError(f"IPC handle {field} must be one of {sorted(classes[field])}, got {value!r}")
            out[field] = names[0]
        elif field == "dtype":
            out[field] = str(value).removeprefix("torch.")
        elif field in ("tensor_size", "tensor_stride"):
            out[field] = [int(v) for v in value]
        elif field in _IPC_BYTES:
            out[field] = None if value is None else base64.b64encode(bytes(value)).decode("ascii")
        elif field in _IPC_BOOLS:
            out[field] = bool(value)
        else:
            out[field] = int(value)
    if not isinstance(getattr(torch, out["dtype"], None), torch.dtype):
        raise ValueError(f"not a torch dtype: {out['dtype']!r}")
    return out


def decode_ipc_handle(data: Mapping[str, Any]) -> tuple[Any, ...]:
    """The ``rebuild_cuda_tensor`` arguments :func:`encode_ipc_handle` wrote; anything else (another
    class, a field missing or of the wrong type) raises ``ValueError``."""
    import torch

    classes = _ipc_classes()
    if not isinstance(data, Mapping) or set(data) != set(_IPC_FIELDS):
        raise ValueError(f"a CUDA IPC handle is an object with exactly the fields {list(_IPC_FIELDS)}")
    args: list[Any] = []
    for field in _IPC_FIELDS:
        value = data[field]
        if field in classes:
            if value not in classes[field]:
                raise ValueError(f"IPC handle {field} must be one of {sorted(classes[field])}, got {value!r}")
            args.append(classes[field][value])
        elif field == "dtype":
            dtype = getattr(torch, value, None) if isinstance(value, str) else None
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"IPC handle dtype must name a torch dtype, got {value!r}")
            args.append(dtype)
        elif field in ("tensor_size", "tensor_stride"):
            if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
                raise ValueError(f"IPC handle {field} must be a list of ints >= 0, got {value!r}")
            args.append(torch.Size(value) if field == "tensor_size" else tuple(value))
        elif field in _IPC_BYTES:
            if value is not None and not isinstance(value, str):
                raise ValueError(f"IPC handle {field} must be base64 text or null")
            args.append(None if value is None else base64.b64decode(value, validate=True))
        elif field in _IPC_BOOLS:
            if not isinstance(value, bool):
                raise ValueError(f"IPC handle {field} must be a boolean")
            args.append(value)
        else:
            if not _is_int(value):
                raise ValueError(f"IPC handle {field} must be an int, got {value!r}")
            args.append(value)
    return tuple(args)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ipc_classes() -> dict[str, dict[str, Any]]:
    """The classes a CUDA IPC handle may name, by field and name (torch imported lazily)."""
    import torch

    return {
        "tensor_cls": {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter},
        "storage_cls": {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage},
    }


class WeightSyncWorkerExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``): loads new weights in place.

    ``self.model_runner`` is the worker's model runner (vLLM sets it up); the methods, reached
    through ``AsyncLLM.collective_rpc``, take only values vLLM's msgpack carries (JSON-like
    data and ``bytes``). Every name is prefixed ``gymbridge_`` so none shadows a worker's own.

    LoRA adapter tensors (:func:`~gymbridge.generation.weights.is_adapter_name`) are not loaded
    into the model: the first worker of each node keeps them (CPU copies, under peft's file names)
    until :meth:`gymbridge_write_adapter` writes them as the adapter directory vLLM's LoRA loader
    reads on every worker of that node.
    """

    model_runner: Any
    gymbridge_adapter: dict[str, Any]
    """Adapter tensors received since the last :meth:`gymbridge_write_adapter`, by peft file name."""
    # vLLM's Worker's own (the extension is mixed into it): annotations only, never shadowed
    vllm_config: Any
    device: Any
    weight_transfer_engine: Any
    update_weights: Callable[[Any], None]

    def gymbridge_load_bucket(self, bucket: dict[str, Any], payload: bytes) -> int:
        """Load one bucket sent in-band: its layout (``Bucket.to_json()``) and its raw bytes.

        Returns how many tensors it held; a payload of the wrong size raises ``WeightSyncError``.
        """
        from gymbridge.generation.weights import Bucket, bucket_from_bytes, unbucket

        parsed = Bucket.from_json(bucket)
        flat = bucket_from_bytes(parsed, payload).to(self._gymbridge_device())
        self._gymbridge_load((s.name, view) for s, view in unbucket(parsed, flat))
        return len(parsed.specs)

    def gymbridge_join_weight_group(
        self, host: str, port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> int:
        """Join the trainer's weight group as ``rank_offset`` + this worker's world rank; returns the rank."""
        from gymbridge.generation.weights import open_weight_group, weight_store

        rank = rank_offset + _worker_world_rank()
        store = weight_store(host, port, world_size=world_size, is_host=False, timeout_s=timeout_s)
        self.gymbridge_weight_group = open_weight_group(
            store,
            rank=rank,
            world_size=world_size,
            backend="nccl" if backend == "nccl" else "gloo",
            timeout_s=timeout_s,
        )
        return rank

    def gymbridge_receive_weights(self, buckets: list[dict[str, Any]], timeout_s: float) -> int:
        """Receive one version's buckets (JSON, see ``Bucket``) and load them; returns tensors loaded."""
        import torch

        from gymbridge.generation.weights import Bucket, dtype_from_name, unbucket

        group = getattr(self, "gymbridge_weight_group", None)
        if group is None:
            raise WeightSyncError("this worker has not joined a weight group")
        self.gymbridge_clear_adapter()  # what a failed earlier receive left is not this version's
        device = self._gymbridge_device()
        loaded = 0
        for raw in buckets:
            bucket = Bucket.from_json(raw)
            flat = torch.empty(bucket.numel, dtype=dtype_from_name(bucket.dtype), device=device)
            group.broadcast(flat, timeout_s=timeout_s)
            self._gymbridge_load((s.name, view) for s, view in unbucket(bucket, flat))
            loaded += len(bucket.specs)
            del flat
        return loaded

    def gymbridge_clear_adapter(self) -> None:
        """Drop the adapter tensors kept since the last write (a new version starts)."""
        self.gymbridge_adapter = {}

    def gymbridge_write_adapter(self, path: str, settings: dict[str, Any]) -> int:
        """Write the adapter tensors kept since the last write to ``path`` as a peft adapter directory
        (:func:`gymbridge.generation.lora.write_adapter_dir`, ``settings`` its ``adapter_config.json``)
        and forget them; returns how many it wrote (0 on a worker that keeps none: not the first of
        its node). A first worker that kept none raises ``WeightSyncError``."""
        from gymbridge.generation.lora import write_adapter_dir

        tensors = getattr(self, "gymbridge_adapter", None) or {}
        self.gymbridge_adapter = {}
        if not _writes_adapters():
            return 0
        if not tensors:
            raise WeightSyncError("no LoRA adapter tensor arrived since the last adapter was written")
        write_adapter_dir(path, tensors, settings)
        return len(tensors)

    def gymbridge_remove_adapter(self, path: str) -> bool:
        """Remove an adapter directory :meth:`gymbridge_write_adapter` wrote (its node's first worker)."""
        if not _writes_adapters():
            return False
        shutil.rmtree(path, ignore_errors=True)
        return True

    # -- vLLM's own weight transfer (``vllm.distributed.weight_transfer``; VLLMWeightSink.vllm_transfer)

    def gymbridge_device_uuid(self) -> str:
        """This worker's GPU's UUID as vLLM's IPC engine names it (``""`` off CUDA): a trainer on the
        same GPU sends IPC handles, one elsewhere broadcasts over NCCL."""
        import torch

        device = self._gymbridge_device()
        if device.type != "cuda":
            return ""
        return str(torch.cuda.get_device_properties(device).uuid)

    def gymbridge_use_weight_transfer(self, backend: str) -> str:
        """Make this worker's ``weight_transfer_engine`` vLLM's engine for ``backend`` (``nccl``,
        ``ipc``), built by vLLM's ``WeightTransferEngineFactory`` as the worker builds the one its
        ``weight_transfer_config`` names; an engine of another backend is shut down first. Returns
        the engine's class name."""
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        if backend not in TRANSFER_BACKENDS:
            raise WeightSyncError(f"weight transfer backend must be one of {list(TRANSFER_BACKENDS)}")
        current = getattr(self, "weight_transfer_engine", None)
        if current is not None and getattr(current.config, "backend", None) == backend:
            return type(current).__name__
        if current is not None:
            current.shutdown()
        self.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend=backend),
            self.vllm_config,
            self.device,
            self.model_runner.get_model(),
        )
        return type(self.weight_transfer_engine).__name__

    def gymbridge_checkpoint_names(self, names: list[str]) -> list[str]:
        """Each trainer name as this worker's model loads it (:func:`checkpoint_name`): vLLM's engines
        hand the names they receive to ``load_weights`` unchanged."""
        model = self.model_runner.model
        return [checkpoint_name(model, n) for n in names]

    def gymbridge_update_weights_ipc(self, update_info: dict[str, Any]) -> int:
        """vLLM's ``Worker.update_weights`` with the IPC handles decoded (:func:`decode_ipc_handle`):
        ``collective_rpc`` carries them as JSON, vLLM's IPC engine rebuilds tensors from the
        decoded arguments. Returns how many tensors the update named."""
        info = dict(update_info)
        handles = info.get("ipc_handles")
        if isinstance(handles, list):
            info["ipc_handles"] = [{uuid: decode_ipc_handle(a) for uuid, a in h.items()} for h in handles]
        elif isinstance(handles, dict):
            info["ipc_handles"] = {uuid: decode_ipc_handle(a) for uuid, a in handles.items()}
        else:
            raise WeightSyncError("an IPC weight update carries 'ipc_handles' (a list, or one packed handle)")
        self.update_weights(info)
        return len(info.get("names") or ())

    def gymbridge_abort_weight_update(self) -> bool:
        """After a failed ``update_weights``: finish the engine's layerwise reload (layers that got
        nothing get their weights back) and leave no update active; ``False`` without an engine."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            return False
        try:
            engine.finish_weight_update()
        finally:
            engine.reset_weight_update_target()
            self._weight_update_active = False
        return True

    def _gymbridge_device(self) -> Any:
        return next(self.model_runner.model.parameters()).device

    def _gymbridge_load(self, named: Iterable[tuple[str, Any]]) -> None:
        """Full tensors into the model (its ``load_weights``); adapter tensors kept for the adapter
        directory, under peft's file name of the checkpoint name vLLM's LoRA loader maps."""
        from gymbridge.generation.lora import adapter_file_name
        from gymbridge.generation.weights import is_adapter_name

        model = self.model_runner.model
        keep: bool | None = None  # asked once, and only of a LoRA publication
        full: list[tuple[str, Any]] = []
        for name, tensor in named:
            target = checkpoint_name(model, name)
            if not is_adapter_name(name):
                full.append((target, tensor))
                continue
            if keep is None:
                keep = _writes_adapters()
                if getattr(self, "gymbridge_adapter", None) is None:
                    self.gymbridge_adapter = {}
            if keep:
                self.gymbridge_adapter[adapter_file_name(target)] = tensor.detach().to("cpu", copy=True)
        if full:
            model.load_weights(weights=full)


SUBMODEL_PREFIXES: tuple[str, ...] = ("thinker.",)
"""Prefixes of a checkpoint's sub-model that vLLM serves alone (Qwen2.5-Omni's thinker)."""


def checkpoint_name(model: Any, name: str) -> str:
    """``name`` (a trainer's state-dict name) as ``model.load_weights`` expects it.

    vLLM's Qwen2.5-Omni thinker loads the whole Omni checkpoint: its ``hf_to_vllm_mapper``
    maps ``thinker.model.`` / ``thinker.lm_head.`` onto its language model and strips
    ``thinker.`` elsewhere. A trainer training the thinker alone
    (``Qwen2_5OmniThinkerForConditionalGeneration``) names the same weights ``model.*``,
    ``lm_head.*``, ``visual.*``, ``audio_tower.*``. So where the model's mapper strips a
    :data:`SUBMODEL_PREFIXES` prefix, a name without it gets it; any other name is unchanged.
    """
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    prefixes = getattr(mapper, "orig_to_new_prefix", None) or {}
    for prefix in SUBMODEL_PREFIXES:
        if prefixes.get(prefix) == "" and not name.startswith(prefix):
            return prefix + name
    return name


def audio_for_vllm(item: Any, sampling_rate: int | None) -> tuple[Any, int]:
    """A decoded clip ``(wave [N] or [N, C], rate)`` as handed to vLLM: ``(mono [N'], rate')``.

    gymbridge decodes audio samples x channels and counts its placeholders on the clip
    down-mixed and resampled to the feature extractor's ``sampling_rate`` (PyAV,
    :func:`~gymbridge.tensors.processor.mono_audio_at`). vLLM resamples along the last axis
    and reads 2-D audio as channels x samples, so a stereo clip at another rate was
    resampled across its channels. This hands vLLM that very mono waveform at
    ``sampling_rate`` (vLLM's resampler is then a no-op); without a known rate, the mono
    clip at its own rate.
    """
    from gymbridge.tensors.processor import mono_audio_at

    wave, rate = item
    target = int(sampling_rate or rate)
    return mono_audio_at(wave, int(rate), target), target


def _worker_world_rank() -> int:
    from vllm.distributed.parallel_state import get_world_group

    return int(get_world_group().rank)


def _writes_adapters() -> bool:
    """Whether this worker writes its node's adapter directories (vLLM's first local rank)."""
    from vllm.distributed.parallel_state import is_local_first_rank

    return bool(is_local_first_rank())


def placeholder_token_ids(hf_config: Any) -> dict[str, int]:
    """Modality -> the placeholder id its processor expands (the model family's
    :meth:`~gymbridge.families.ModelFamily.placeholder_ids`: ``image_token_id`` / ``*_token_index``,
    on any of :func:`~gymbridge.hf_config.model_sub_configs`)."""
    from gymbridge.families import family_of

    return family_of(hf_config).placeholder_ids(hf_config)


def collapse_placeholders(
    prompt_token_ids: Sequence[int],
    media_counts: dict[str, int],
    placeholders: dict[str, int],
    *,
    family: Any = None,
    hf_config: Any = None,
    tokenizer: Any = None,
) -> list[int]:
    """``prompt_token_ids`` with each item's expansion cut back to one placeholder (module docstring).

    Generic (no ``family``): each run of a modality's placeholder id (``placeholders``) becomes one
    token. With a ``family`` (and the engine's ``hf_config`` / the ``tokenizer``), the family's rule
    (:meth:`~gymbridge.families.ModelFamily.vllm_prompt`). Only modalities with media are
    collapsed; each must have exactly one item per medium (else :class:`VLLMGenerationError`:
    the prompt and its media disagree).
    """
    from gymbridge.families import collapse_runs

    out: list[int]
    found: dict[str, int]
    if family is not None and hf_config is not None:
        out, found = family.vllm_prompt(prompt_token_ids, media_counts, hf_config, tokenizer)
    else:
        collapse = {placeholders[m]: m for m, n in media_counts.items() if n and m in placeholders}
        out, found = collapse_runs(prompt_token_ids, collapse)
    for modality, count in found.items():
        if count != media_counts.get(modality, 0):
            raise VLLMGenerationError(
                f"the prompt holds {count} run(s) of {modality} placeholders for "
                f"{media_counts.get(modality, 0)} {modality} item(s): each item needs exactly one run"
            )
    return out


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def generation_from_output(
    output: Any, policy_version: int | None = None, expected_prompt: Sequence[int] | None = None
) -> Generation:
    """A vLLM ``RequestOutput`` (one completion, ``logprobs=0``) -> :class:`Generation`.

    With ``expected_prompt`` (the prompt the trajectory records), vLLM's reported prompt ids
    must equal it (else :class:`VLLMGenerationError` naming the first difference), and the
    generation's ``prompt_token_ids`` is that recorded prompt.
    """
    if not output.outputs:
        raise VLLMGenerationError(f"request {output.request_id}: vLLM returned no completion")
    completion = output.outputs[0]
    token_ids = [int(t) for t in completion.token_ids]
    if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
        raise VLLMGenerationError(
            f"request {output.request_id}: vLLM returned {len(token_ids)} tokens but "
            f"{0 if completion.logprobs is None else len(completion.logprobs)} logprob entries"
        )
    logprobs: list[float] = []
    for pos, (tok, entry) in enumerate(zip(token_ids, completion.logprobs, strict=True)):
        lp = entry.get(tok) if hasattr(entry, "get") else None
        if lp is None:
            raise VLLMGenerationError(f"request {output.request_id}: no logprob for sampled token {pos}")
        logprobs.append(float(getattr(lp, "logprob", lp)))
    reason = completion.finish_reason
    if reason not in ("stop", "length"):
        raise VLLMGenerationError(f"request {output.request_id}: finished with {reason!r}")
    finish: FinishReason = "stop" if reason == "stop" else "length"
    reported = [int(t) for t in output.prompt_token_ids or []]
    if expected_prompt is not None:
        expected = list(expected_prompt)
        if reported != expected:
            at = _first_difference(reported, expected)
            raise VLLMGenerationError(
                f"request {output.request_id}: vLLM ran a prompt of {len(reported)} tokens but the "
                f"trajectory records {len(expected)}; first difference at position {at} "
                f"(vLLM {reported[at : at + 3]}, recorded {expected[at : at + 3]}): the media "
                "placeholders were expanded differently"
            )
        reported = expected
    return Generation(token_ids, logprobs, finish, reported, policy_version)


@dataclass(eq=False)
class _Adapter:
    """One adapter version registered with the engine: its ``LoRARequest``, its directory (written by
    the workers) and how many submitted requests still carry it."""

    request: Any
    path: str
    in_flight: int = 0


class VLLMGenerator:
    """Generate with vLLM's ``AsyncLLM``; see the module docstring.

    Pass ``engine`` to wrap an engine built elsewhere (it needs ``generate``,
    ``collective_rpc``, ``pause_generation`` / ``resume_generation``, ``reset_prefix_cache``
    and ``reset_encoder_cache``, as ``AsyncLLM`` has them); otherwise one is built from
    ``model`` and ``engine_args`` (``AsyncEngineArgs`` keywords). ``codec`` (the
    :class:`ChatCodec` the model server and native rollouts need) is built from
    ``processor``, else from the processor saved with ``model`` unless
    ``load_processor=False``; it parses tool calls in ``tool_parser``'s format
    (:mod:`gymbridge.generation.tool_calls`; ``auto``: the one the chat template writes).
    ``weight_transfer_backend`` (``nccl``, the default, or ``ipc``; ``None``: off) is the engine arg
    ``weight_transfer_config`` set where vLLM ships its weight-transfer protocol and
    ``engine_args`` name none (so vLLM builds with runtime weight updates in mind); a trainer may
    still switch the backend at its handshake (:meth:`VLLMWeightSink.vllm_transfer`).
    """

    continuous_batching = True
    """vLLM batches concurrent requests itself: no :class:`BatchingGenerator` in front of it."""

    def __init__(
        self,
        model: str,
        *,
        engine_args: dict[str, Any] | None = None,
        engine: Any | None = None,
        max_model_len: int | None = None,
        processor: Any | None = None,
        load_processor: bool = True,
        reasoning_parser: bool = True,
        tool_parser: str = "auto",
        suppress_token_ids: Sequence[int] | None = None,
        weight_transfer_backend: str | None = "nccl",
    ) -> None:
        self.model_name = model
        self._vllm = import_vllm()
        args: dict[str, Any] = {
            "model": model,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": _EXTENSION_PATH,
        }
        transfer = weight_transfer_backend is not None and weight_transfer_available()
        if transfer:
            if weight_transfer_backend not in TRANSFER_BACKENDS:
                raise ValueError(f"weight_transfer_backend must be one of {list(TRANSFER_BACKENDS)} or None")
            args["weight_transfer_config"] = {"backend": weight_transfer_backend}
        args.update(engine_args or {})
        if max_model_len is not None:
            args["max_model_len"] = max_model_len
        if engine is None:
            from vllm.v1.engine.async_llm import AsyncLLM

            engine = AsyncLLM.from_engine_args(self._vllm.AsyncEngineArgs(**args))
        self.engine = engine
        self.weight_transfer: bool = transfer and callable(getattr(engine, "start_weight_update", None))
        """Whether the engine takes vLLM's weight-transfer protocol (:meth:`VLLMWeightSink.vllm_transfer`)."""
        self.max_model_len: int = int(
            max_model_len or getattr(getattr(engine, "model_config", None), "max_model_len", 0) or 32768
        )
        self._ids = itertools.count()
        self.policy_version: int = 0
        """Version of the weights the engine now holds (0: the initial weights)."""
        hf_config = getattr(getattr(engine, "model_config", None), "hf_config", None)
        found = media_special_token_ids(hf_config) if hf_config is not None else ()
        self.suppressed_token_ids: tuple[int, ...] = tuple(sorted(set(found) | set(suppress_token_ids or ())))
        """Ids never sampled (``logit_bias`` -inf); the trainer must renormalise without them."""
        from gymbridge.families import family_of

        self._hf_config = hf_config
        self.family = family_of(hf_config) if hf_config is not None else None
        """The model's family: its rule for the prompt vLLM's processor expects."""
        self.placeholder_token_ids: dict[str, int] = (
            placeholder_token_ids(hf_config) if hf_config is not None else {}
        )
        """Modality -> the placeholder id vLLM's processor expands (collapsed to one per item here)."""
        self.codec: Any = None
        self.audio_sampling_rate: int | None = None
        """The feature extractor's rate: audio is handed to vLLM mono at it (:func:`audio_for_vllm`)."""
        self._weights_ready = asyncio.Event()
        self._weights_ready.set()
        self._swap_lock = asyncio.Lock()  # one weight swap at a time
        self.lora_settings: dict[str, Any] | None = None
        """The trainer's adapter settings (:meth:`prepare_lora`); ``None``: full weights travel."""
        self._adapter: _Adapter | None = None  # the adapter new requests carry (None: the base)
        self._adapters: list[_Adapter] = []  # registered with the engine, not yet removed
        self._adapter_ids = itertools.count(1)  # vLLM's lora_int_id: > 0, one per version
        self._adapter_root: tempfile.TemporaryDirectory[str] | None = None
        if processor is None and load_processor:
            try:
                import transformers

                processor = transformers.AutoProcessor.from_pretrained(model)  # type: ignore[no-untyped-call]
            except (OSError, ValueError):
                processor = None
        if processor is not None:
            from gymbridge.generation.chat import ChatCodec
            from gymbridge.tensors.processor import sub_processors

            self.codec = ChatCodec(processor, reasoning_parser=reasoning_parser, tool_parser=tool_parser)
            rate = getattr(sub_processors(processor).get("audio"), "sampling_rate", None)
            self.audio_sampling_rate = int(rate) if isinstance(rate, int | float) and rate > 0 else None

    def build_request(self, inp: GenerationInput, sampling: SamplingConfig) -> tuple[Any, Any]:
        """The ``(TokensPrompt, SamplingParams)`` pair sent for one input (pure; no engine)."""
        from vllm.inputs import TokensPrompt

        counts = {m: len(v) for m, v in inp.multi_modal_data.items()}
        ids = collapse_placeholders(
            inp.prompt_token_ids,
            counts,
            self.placeholder_token_ids,
            family=self.family,
            hf_config=self._hf_config,
            tokenizer=getattr(self.codec, "tokenizer", None),
        )
        prompt: Any = TokensPrompt(prompt_token_ids=ids)
        if inp.multi_modal_data:
            prompt["multi_modal_data"] = {
                k: [audio_for_vllm(a, self.audio_sampling_rate) for a in v] if k == "audio" else list(v)
                for k, v in inp.multi_modal_data.items()
            }
        params = self._vllm.SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=sampling.seed,
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
            logit_bias={t: float("-inf") for t in self.suppressed_token_ids} or None,
        )
        return prompt, params

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` every request submitted now carries (``None``: the base model)."""
        return None if self._adapter is None else self._adapter.request

    async def _one(self, inp: GenerationInput, sampling: SamplingConfig) -> Generation:
        prompt, params = self.build_request(inp, sampling)
        request_id = f"gymbridge-{next(self._ids)}"
        # the version (and adapter) at submission (a swap in progress is waited for): a request in
        # flight across a swap records the older version
        await self._weights_ready.wait()
        version = self.policy_version
        adapter = self._adapter
        extra: dict[str, Any] = {}
        if adapter is not None:
            adapter.in_flight += 1
            extra["lora_request"] = adapter.request
        final: Any = None
        try:
            async for out in self.engine.generate(prompt, params, request_id, **extra):
                final = out
        finally:
            if adapter is not None:
                adapter.in_flight -= 1
                if adapter is not self._adapter and adapter.in_flight == 0:
                    await self._retire_unused()
        if final is None or not getattr(final, "finished", True):
            raise VLLMGenerationError(f"request {request_id}: the engine stream ended without a final output")
        return generation_from_output(final, version, inp.prompt_token_ids)

    async def generate(self, inputs: Sequence[GenerationInput], sampling: SamplingConfig) -> list[Generation]:
        return await self.generate_rows(inputs, sampling, row_seeds(sampling.seed, len(inputs)))

    async def generate_rows(
        self, inputs: Sequence[GenerationInput], sampling: SamplingConfig, seeds: Sequence[int | None]
    ) -> list[Generation]:
        """Row ``j`` as its own request with ``SamplingParams.seed = seeds[j]`` (vLLM seeds each
        request's sampler apart: :class:`~gymbridge.generation.types.RowSeededGenerator`)."""
        if len(seeds) != len(inputs):
            raise ValueError(f"{len(seeds)} seeds for {len(inputs)} inputs")
        # each row's max_tokens is fitted to its own room (checked for all rows before any request)
        fitted = [
            fit_max_tokens(len(i.prompt_token_ids), replace(sampling, seed=seed), self.max_model_len)
            for i, seed in zip(inputs, seeds, strict=True)
        ]
        # vLLM batches concurrent requests itself (continuous batching).
        return list(await asyncio.gather(*(self._one(i, s) for i, s in zip(inputs, fitted, strict=True))))

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        *,
        version: int | None = None,
        bucket_bytes: int | None = None,
    ) -> int:
        """Load new policy weights into every worker (a :meth:`swap_weights`); returns tensors loaded.

        The weights travel as buckets of at most ``bucket_bytes`` raw bytes through
        ``collective_rpc`` (vLLM's msgpack carries ``bytes``, not tensors), one bucket
        materialised at a time, through host memory: for large models on their own GPUs the
        trainer's NCCL broadcast (:class:`VLLMWeightSink`) is the fast path. ``bucket_bytes``
        defaults to ``DEFAULT_BUCKET_BYTES`` (64 MiB); ``version``, when given, becomes
        :attr:`policy_version`. After :meth:`prepare_lora` the tensors are a LoRA publication
        (adapters, and encoder tensors with ``vision: full``): the adapters become a new vLLM
        adapter (:meth:`load_version`).
        """
        import torch

        from gymbridge.generation.weights import (
            DEFAULT_BUCKET_BYTES,
            bucket_tensors,
            bucket_to_bytes,
            plan_buckets,
        )

        named = [(name, t.detach()) for name, t in named_tensors]
        if len({name for name, _ in named}) != len(named):
            raise WeightSyncError("update_weights was given a tensor name twice")
        by_name = dict(named)
        buckets = plan_buckets(named, DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes)
        cpu = torch.device("cpu")

        async def load() -> None:
            if self.lora_settings is not None:
                await self.engine.collective_rpc("gymbridge_clear_adapter")
            for bucket in buckets:
                flat = bucket_tensors(bucket, [by_name[s.name] for s in bucket.specs], cpu)
                payload = bucket_to_bytes(flat)
                del flat
                await self.engine.collective_rpc("gymbridge_load_bucket", args=(bucket.to_json(), payload))

        await self.load_version(load, names=list(by_name), version=version)
        logger.info("loaded %d tensors (%d buckets) into vLLM", len(named), len(buckets))
        return len(named)

    async def swap_weights(self, load: Callable[[], Awaitable[Any]], *, version: int | None = None) -> None:
        """Run ``load`` with generation paused, drop every cache of the old weights, resume.

        Policy (module docstring): ``pause_generation(mode="keep")`` (no engine step runs;
        in-flight requests are kept), ``load()``, ``reset_prefix_cache(reset_running_requests=True)``
        (running requests are preempted and later recomputed under the new weights), then
        ``reset_encoder_cache()``. A reset vLLM refuses raises :class:`WeightSyncError`.
        Generation resumes whatever happens; requests submitted meanwhile wait, then record
        ``version`` (set only once the caches are reset). Concurrent swaps run one at a time.
        New requests then run on the loaded weights without a LoRA adapter.
        """
        await self._swap(load, version=version, adapter=None, reset_caches=True)
        await self._retire_unused()

    async def load_version(
        self, load: Callable[[], Awaitable[Any]], *, names: Sequence[str], version: int | None = None
    ) -> None:
        """One publication: ``load`` brings the tensors ``names`` to every worker.

        Without LoRA settings (:meth:`prepare_lora`) it is a :meth:`swap_weights`. With them, the
        workers write the adapter tensors as a new adapter directory under this generator's
        temporary folder (``gymbridge_write_adapter``), vLLM registers it
        (``AsyncLLM.add_lora(LoRARequest(...))``, a new ``lora_int_id`` per version: vLLM caches
        adapters by id) and requests submitted after the swap carry it. Only when full tensors came
        too (``vision: full``) are the prefix and encoder caches reset: vLLM keys cached KV blocks by
        the adapter's name, so no block of an older adapter is reused, and requests in flight finish
        on the adapter they started with. An older adapter is removed (``remove_lora``, its
        directory deleted) once no request carries it. A failed publication removes its adapter and
        leaves the current one in place.
        """
        from gymbridge.generation.weights import is_adapter_name

        settings = self.lora_settings
        if settings is None:
            await self.swap_weights(load, version=version)
            return
        adapter_count = sum(1 for n in names if is_adapter_name(n))
        adapter = self._new_adapter(version)
        registered = False

        async def load_and_register() -> None:
            nonlocal registered
            await load()
            written = await self.engine.collective_rpc(
                "gymbridge_write_adapter", args=(adapter.path, settings)
            )
            counts = [int(n) for n in written or () if n]
            if not counts or any(n != adapter_count for n in counts):
                raise WeightSyncError(
                    f"the vLLM workers wrote {counts or 'no'} adapter tensors to {adapter.path}; "
                    f"{adapter_count} were sent"
                )
            registered = True
            if await self.engine.add_lora(adapter.request) is not True:
                raise WeightSyncError(f"vLLM did not load the LoRA adapter {adapter.path}")

        try:
            await self._swap(
                load_and_register, version=version, adapter=adapter, reset_caches=adapter_count < len(names)
            )
        except BaseException:
            await self._remove_adapter(adapter, registered=registered)
            raise
        await self._retire_unused()
        logger.info("serving LoRA adapter %s (%d tensors)", adapter.request.lora_name, adapter_count)

    async def _swap(
        self,
        load: Callable[[], Awaitable[Any]],
        *,
        version: int | None,
        adapter: _Adapter | None,
        reset_caches: bool,
    ) -> None:
        async with self._swap_lock:
            self._weights_ready.clear()
            try:
                await self.engine.pause_generation(mode="keep", clear_cache=False)
                try:
                    await load()
                    if reset_caches:
                        await self._drop_stale_caches()
                    if version is not None:
                        self.policy_version = version
                    if adapter is not None:
                        self._adapters.append(adapter)
                    self._adapter = adapter
                finally:
                    await self.engine.resume_generation()
            finally:
                self._weights_ready.set()

    def prepare_lora(self, settings: Mapping[str, Any] | None) -> None:
        """Serve a LoRA trainer's adapters (``settings``: :func:`gymbridge.generation.lora.lora_settings`'s
        dict), or full weights (``None``: the current adapter is served until the next version).

        Refused (:class:`WeightSyncError`) when the engine was started without LoRA (engine args
        ``enable_lora``, ``max_lora_rank``; ``gymbridge model serve --enable-lora``) or the rank
        ``settings["r"]`` exceeds its ``max_lora_rank``.
        """
        if settings is None:
            self.lora_settings = None
            return
        rank = settings.get("r")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise WeightSyncError(f"the LoRA settings' rank 'r' must be a positive int, got {rank!r}")
        config = getattr(getattr(self.engine, "vllm_config", None), "lora_config", None)
        if config is None:
            raise WeightSyncError(
                f"the trainer publishes LoRA adapters (rank {rank}) but this vLLM engine was started "
                "without LoRA: serve with --enable-lora --max-lora-rank R (R >= the rank; engine args "
                "enable_lora / max_lora_rank)"
            )
        max_rank = int(config.max_lora_rank)
        if rank > max_rank:
            raise WeightSyncError(
                f"the trainer's LoRA rank {rank} exceeds this vLLM engine's max_lora_rank {max_rank}: "
                f"serve with --max-lora-rank >= {rank}"
            )
        self.lora_settings = dict(settings)

    def _new_adapter(self, version: int | None) -> _Adapter:
        from vllm.lora.request import LoRARequest

        if self._adapter_root is None:
            self._adapter_root = tempfile.TemporaryDirectory(prefix="gymbridge-lora-")
        lora_id = next(self._adapter_ids)
        name = f"gymbridge-{lora_id}" if version is None else f"gymbridge-{lora_id}-v{version}"
        path = str(Path(self._adapter_root.name) / name)
        return _Adapter(LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path), path)

    async def _retire_unused(self) -> None:
        """Remove every registered adapter that new requests no longer get and none in flight carries."""
        stale = [a for a in self._adapters if a is not self._adapter and a.in_flight == 0]
        if not stale:
            return
        self._adapters = [a for a in self._adapters if all(a is not s for s in stale)]
        for adapter in stale:
            await self._remove_adapter(adapter, registered=True)

    async def _remove_adapter(self, adapter: _Adapter, *, registered: bool) -> None:
        try:
            if registered:
                await self.engine.remove_lora(adapter.request.lora_int_id)
            await self.engine.collective_rpc("gymbridge_remove_adapter", args=(adapter.path,))
        except Exception as exc:  # cleanup only: the adapter is no longer served either way
            logger.warning("could not remove the LoRA adapter %s: %s", adapter.path, exc)

    async def _drop_stale_caches(self) -> None:
        try:
            reset = await self.engine.reset_prefix_cache(reset_running_requests=True)
        except RuntimeError as exc:  # vLLM: running requests still hold KV (remote KV transfer)
            raise WeightSyncError(f"vLLM could not reset its prefix cache after new weights: {exc}") from exc
        if reset is not True:
            raise WeightSyncError(
                f"vLLM did not reset its prefix cache after new weights (reset_prefix_cache returned "
                f"{reset!r}): KV computed under the old weights would be reused"
            )
        await self.engine.reset_encoder_cache()


def _timeout(body: Mapping[str, Any]) -> float:
    value = body.get("timeout_s", 120.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 86_400:
        raise ValueError(f"'timeout_s' must be a number of seconds in (0, 86400], got {value!r}")
    return float(value)


def lora_layout_problems(names: Sequence[str], settings: Mapping[str, Any]) -> list[str]:
    """Every way the tensor ``names`` of one publication are not what a LoRA trainer with ``settings``
    sends vLLM; ``[]`` if none.

    A LoRA publication carries the adapters (:func:`~gymbridge.generation.weights.is_adapter_name`:
    ``lora_A`` / ``lora_B``; DoRA's magnitude vectors are refused, vLLM has no DoRA) and, with
    ``vision: full`` or ``full_modules`` only, full tensors that the model's ``load_weights`` takes.
    The base weights never travel: a peft-wrapped base weight (``.base_layer.``) is refused.
    """
    from gymbridge.generation.weights import is_adapter_name

    vision = settings.get("vision", "frozen")
    in_full = {str(m) for m in settings.get("full_modules") or ()}
    problems: list[str] = []
    full: list[str] = []
    for name in names:
        if ".lora_magnitude_vector" in name:
            problems.append(f"{name}: a DoRA magnitude vector (vLLM serves no DoRA)")
        elif is_adapter_name(name):
            continue
        elif ".base_layer." in name:
            problems.append(f"{name}: a LoRA-wrapped base weight (the base model never travels)")
        elif vision != "full" and not (in_full & set(name.split(".")[:-1])):
            full.append(name)
    if full:
        shown = ", ".join(full[:3]) + (", ..." if len(full) > 3 else "")
        problems.append(
            f"{len(full)} full tensor(s) ({shown}) in a LoRA publication with vision {vision!r}: only "
            "adapters travel (vision 'full' publishes the encoders' tensors)"
        )
    if not any(is_adapter_name(n) for n in names):
        problems.append("a LoRA publication carries its adapter tensors (lora_A / lora_B); none is named")
    return problems


class VLLMWeightSink:
    """The model server's :class:`~gymbridge.generation.weights.WeightSink` for a :class:`VLLMGenerator`.

    Every vLLM worker is a member of the trainer's weight group (``ranks`` = the engine's
    parallel world size); the server's own process joins only the group's store, to mark each
    version loaded. Layout names are Hugging Face names that each worker's ``load_weights``
    maps (vLLM fuses q/k/v and gate/up), so here they are checked for duplicates only; a name
    the model does not know fails inside ``load_weights`` and the version is marked failed.
    A LoRA trainer's settings (:meth:`prepare_lora`, before :meth:`check`) make each version an
    adapter registered through vLLM's LoRA path (:meth:`VLLMGenerator.load_version`).

    Where the engine speaks vLLM's own weight-transfer protocol (:attr:`speaks_vllm_transfer`), a
    trainer of full weights uses :meth:`vllm_transfer` instead (``transport: "vllm"`` on the
    ``/weights/*`` routes; :mod:`gymbridge.trainer.vllm_transfer`).
    """

    def __init__(self, generator: VLLMGenerator) -> None:
        self.generator = generator
        config = getattr(getattr(generator.engine, "vllm_config", None), "parallel_config", None)
        self.ranks = int(getattr(config, "world_size", 1) or 1)
        self._store: Any = None
        self.transfer_backend: str | None = None
        """The vLLM weight-transfer engine a trainer set up (``nccl`` / ``ipc``; ``None``: none)."""
        self._transfer_names: dict[str, str] = {}  # trainer name -> the name load_weights takes

    @property
    def transport(self) -> str:
        """``vllm`` once a trainer set up vLLM's weight transfer, else ``broadcast`` (``/weights/status``)."""
        return VLLM_TRANSPORT if self.transfer_backend is not None else "broadcast"

    @property
    def speaks_vllm_transfer(self) -> bool:
        """Whether a trainer may publish through vLLM's own weight-transfer protocol
        (:meth:`vllm_transfer`; ``/weights/status`` reports it)."""
        return bool(getattr(self.generator, "weight_transfer", False))

    async def vllm_transfer(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """One call of vLLM's weight-transfer protocol, by ``body["step"]``:

        * ``probe``: ``{"backends", "gpu_uuids" (one per worker), "ranks", "policy_version"}``, what
          the trainer picks its backend from (its GPU among the workers': ``ipc``, else ``nccl``);
        * ``init`` (``backend``, ``init_info``: vLLM's worker init info as the trainer's engine
          builds it, ``tensors``: the layout, ``timeout_s``): every worker gets vLLM's engine for
          ``backend`` and ``AsyncLLM.init_weight_transfer_engine`` runs (with NCCL it returns once
          the trainer has joined the group);
        * ``update`` (``version``, ``update_info``: vLLM's update info, ``timeout_s``): inside a
          :meth:`VLLMGenerator.swap_weights`, ``start_weight_update``, ``update_weights`` (IPC
          handles decoded on the workers: ``gymbridge_update_weights_ipc``), ``finish_weight_update``;
          answers once the version is live.

        Refused (``ValueError`` for a malformed body, :class:`WeightSyncError` otherwise): an engine
        without the protocol, a LoRA publication (adapters keep gymbridge's adapter path), an
        update before ``init``, an older version, names outside the layout sent at ``init``.
        """
        if not self.speaks_vllm_transfer:
            raise WeightSyncError(
                "this vLLM engine does not speak vLLM's weight-transfer protocol "
                "(vllm.distributed.weight_transfer): publish with transport 'broadcast'"
            )
        step = body.get("step")
        if step == "probe":
            return await self._transfer_probe()
        if step == "init":
            return await self._transfer_init(body)
        if step == "update":
            return await self._transfer_update(body)
        raise ValueError(f"'step' must be 'probe', 'init' or 'update', got {step!r}")

    async def _transfer_probe(self) -> dict[str, Any]:
        uuids = await self.generator.engine.collective_rpc("gymbridge_device_uuid")
        return {
            "transport": VLLM_TRANSPORT,
            "backends": list(TRANSFER_BACKENDS),
            "gpu_uuids": [str(u) for u in uuids or ()],
            "ranks": self.ranks,
            "policy_version": self.policy_version,
        }

    async def _transfer_init(self, body: Mapping[str, Any]) -> dict[str, Any]:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from gymbridge.generation.weights import TensorSpec

        backend, init_info, tensors = body.get("backend"), body.get("init_info"), body.get("tensors")
        if backend not in TRANSFER_BACKENDS:
            raise ValueError(f"'backend' must be one of {list(TRANSFER_BACKENDS)}, got {backend!r}")
        if not isinstance(init_info, dict) or not isinstance(tensors, list):
            raise ValueError("'init_info' (vLLM's worker init info) must be an object, 'tensors' a list")
        if body.get("lora") is not None:
            raise WeightSyncError(
                "vLLM's weight transfer carries full weights: a LoRA trainer's adapters keep gymbridge's "
                "adapter path (transport 'broadcast')"
            )
        if backend == "nccl" and (init_info.get("rank_offset"), init_info.get("world_size")) != (
            1,
            1 + self.ranks,
        ):
            raise ValueError(
                f"NCCL init_info must put the workers after the trainer: rank_offset 1, world_size "
                f"{1 + self.ranks} (this engine has {self.ranks} workers)"
            )
        specs = [TensorSpec.from_json(t) for t in tensors]
        self.generator.prepare_lora(None)
        self.check(specs)
        timeout_s = _timeout(body)
        engine = self.generator.engine
        names = [s.name for s in specs]
        answers = await engine.collective_rpc("gymbridge_checkpoint_names", args=(names,))
        self.transfer_backend = None
        self._transfer_names = dict(zip(names, answers[0], strict=True))
        await engine.collective_rpc("gymbridge_use_weight_transfer", args=(backend,))
        request = WeightTransferInitRequest(init_info=dict(init_info))
        try:
            await asyncio.wait_for(engine.init_weight_transfer_engine(request), timeout_s)
        except WeightSyncError:
            raise
        except TimeoutError as exc:
            raise WeightSyncError(
                f"the trainer did not join vLLM's {backend} weight transfer within {timeout_s:g}s"
            ) from exc
        except Exception as exc:  # vLLM's (a refused init info, a failed rendezvous)
            raise WeightSyncError(
                f"vLLM's {backend} weight transfer init failed: {type(exc).__name__}: {exc}"
            ) from exc
        self.transfer_backend = backend
        logger.info(
            "vLLM weight transfer ready (%s, %d workers, %d tensors)", backend, self.ranks, len(specs)
        )
        return {"status": "ready", "transport": VLLM_TRANSPORT, "backend": backend, "ranks": self.ranks}

    async def _transfer_update(self, body: Mapping[str, Any]) -> dict[str, Any]:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        backend = self.transfer_backend
        if backend is None:
            raise WeightSyncError("no vLLM weight transfer set up: send step 'init' first")
        version = body.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < self.policy_version:
            raise ValueError(f"'version' must be an int >= the loaded version {self.policy_version}")
        info = self._transfer_update_info(body.get("update_info"), backend)
        timeout_s = _timeout(body)
        engine = self.generator.engine
        started = time.perf_counter()

        async def load() -> None:
            await engine.start_weight_update()
            try:
                if backend == "ipc":
                    await engine.collective_rpc("gymbridge_update_weights_ipc", args=(info,))
                else:
                    await engine.update_weights(WeightTransferUpdateRequest(update_info=info))
            except BaseException:
                try:
                    await engine.collective_rpc("gymbridge_abort_weight_update")
                except Exception as exc:  # the update's own error is the one to report
                    logger.warning("could not end the failed vLLM weight update: %s", exc)
                raise
            await engine.finish_weight_update()

        async def timed_load() -> None:
            try:
                await asyncio.wait_for(load(), timeout_s)
            except TimeoutError as exc:
                raise WeightSyncError(f"vLLM's {backend} weight update took over {timeout_s:g}s") from exc

        try:
            await self.generator.swap_weights(timed_load, version=version)
        except WeightSyncError:
            raise
        except Exception as exc:  # vLLM's (a loader's assertion, an NCCL error): one error type for the route
            raise WeightSyncError(
                f"vLLM's {backend} weight update failed: {type(exc).__name__}: {exc}"
            ) from exc
        seconds = time.perf_counter() - started
        count = len(info.get("names") or ())
        logger.info("loaded version %d through vLLM's %s weight transfer (%.3fs)", version, backend, seconds)
        return {
            "status": "loaded",
            "version": version,
            "backend": backend,
            "tensors": count,
            "seconds": seconds,
        }

    def _transfer_update_info(self, raw: Any, backend: str) -> dict[str, Any]:
        """vLLM's update info with every name as the model loads it; checked before any tensor moves."""
        import torch

        if not isinstance(raw, dict):
            raise ValueError("'update_info' (vLLM's update info) must be an object")
        info = dict(raw)
        names, dtypes, shapes = info.get("names", []), info.get("dtype_names", []), info.get("shapes", [])
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise ValueError("'names', 'dtype_names' and 'shapes' must be lists")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"{len(names)} names, {len(dtypes)} dtype_names and {len(shapes)} shapes")
        if backend == "ipc" and not names:
            raise ValueError("an IPC update names its tensors")
        unknown = [n for n in names if n not in self._transfer_names]
        if unknown:
            raise WeightSyncError(f"{len(unknown)} tensor(s) outside the layout sent at init: {unknown[:3]}")
        bad = [
            d
            for d in dtypes
            if not isinstance(d, str) or not isinstance(getattr(torch, d, None), torch.dtype)
        ]
        if bad:
            raise ValueError(f"'dtype_names' must name torch dtypes, got {bad[:3]}")
        if any(not isinstance(s, list) or not all(_is_int(d) and d >= 0 for d in s) for s in shapes):
            raise ValueError("'shapes' must be lists of ints >= 0")
        info["names"] = [self._transfer_names[n] for n in names]
        return info

    @property
    def policy_version(self) -> int:
        return self.generator.policy_version

    def prepare_lora(self, settings: dict[str, Any] | None) -> None:
        """The trainer's LoRA settings (``init_group``'s ``lora``): :meth:`VLLMGenerator.prepare_lora`."""
        self.generator.prepare_lora(settings)

    def check(self, specs: Sequence[Any]) -> None:
        """Refuse a layout that names a tensor twice; with LoRA settings, one that is not a LoRA
        publication (:func:`lora_layout_problems`)."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise WeightSyncError("the weight layout names a tensor twice")
        settings = self.generator.lora_settings
        if settings is not None:
            from gymbridge.generation.weights import raise_on_problems

            raise_on_problems(lora_layout_problems(names, settings))

    async def join(
        self, *, host: str, port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        from gymbridge.generation.weights import weight_store

        self._store = await asyncio.to_thread(
            weight_store, host, port, world_size=world_size, is_host=False, timeout_s=timeout_s
        )
        await self.generator.engine.collective_rpc(
            "gymbridge_join_weight_group", args=(host, port, rank_offset, world_size, backend, timeout_s)
        )

    async def receive(self, version: int, buckets: Sequence[Any], *, timeout_s: float) -> float:
        """Every worker receives ``buckets`` over the group, inside a :meth:`VLLMGenerator.swap_weights`."""
        started = time.perf_counter()
        engine = self.generator.engine
        payload = [b.to_json() for b in buckets]

        async def load() -> None:
            await engine.collective_rpc("gymbridge_receive_weights", args=(payload, timeout_s))

        names = [s.name for b in buckets for s in b.specs]
        await self.generator.load_version(load, names=names, version=version)
        return time.perf_counter() - started

    def mark_loaded(self, version: int, outcome: str) -> None:
        from gymbridge.generation.weights import loaded_key

        if self._store is not None:
            self._store.set(loaded_key(version), outcome)

    def close(self) -> None:
        self._store = None
