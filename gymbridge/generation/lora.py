"""LoRA: low-rank adapters on the language model, injected in place with **peft** (``trainer.lora``).

The adapter layout the trainer and every generator share lives here, in the generation layer: a
model server injects the trainer's adapters into its own model and a vLLM server writes them as a
peft directory (:mod:`gymbridge.trainer.lora` is the trainer's name for this module).

:func:`apply_lora` injects peft's LoRA layers into a plain Hugging Face model (peft's
``inject_adapter_in_model``: the model keeps its class, its ``_no_split_modules`` and its forward,
so sharding, packing, encoder dedup and the families' hooks see the model they know) and leaves
only the adapters trainable. A targeted ``nn.Linear`` becomes peft's ``lora.Linear``: its weight is
then named ``<module>.base_layer.weight`` and the adapter's ``<module>.lora_A.default.weight`` /
``<module>.lora_B.default.weight`` (``B`` starts at zero, so an adapter fresh from :func:`apply_lora`
changes no output).

What follows from it (docs/run.md, *LoRA*):

* **targets**: the ``target_modules`` projections of the language model only; every module under a
  media encoder (:data:`~gymbridge.families.encoders.ENCODER_NAMES`) is left out and frozen
  (``vision: frozen``, the default: vLLM ignores adapters on the vision tower unless told otherwise),
  or trained in full (``vision: full``: its full tensors are published after every step beside the
  adapters);
* **the KL reference** is the same model with its adapters switched off (:func:`adapters_disabled`):
  the base model, no second copy;
* **publication** sends only what training changes (:func:`published_names`: the adapters and any
  fully trained tensor); the generator holds the same base and the same injected adapters
  (:func:`apply_lora` with the same config, or the config itself: :func:`peft_config_dict`);
* **files**: :func:`adapter_file_name` maps an in-model adapter name to peft's adapter-file name
  (``base_model.model.<module>.lora_A.weight``), which ``PeftModel.from_pretrained`` and vLLM's LoRA
  loader read; :func:`write_adapter_dir` writes such a directory.

Invariant: with every adapter at its initial (zero ``B``) value the model's outputs are the base
model's exactly; adapters switched off, the outputs are the base model's whatever the adapters hold.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from gymbridge.config import StrictModel
from gymbridge.families.encoders import ENCODER_NAMES, encoder_modules
from gymbridge.generation.weights import ADAPTER_PATTERN, PUBLISHED_NAMES_ATTR, is_adapter_name

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_STRUCTURE",
    "ADAPTER_WEIGHTS",
    "DEFAULT_TARGETS",
    "LoRAConfig",
    "LoRAInfo",
    "adapter_dropout",
    "adapter_file_name",
    "adapter_state",
    "adapters_disabled",
    "apply_lora",
    "has_lora",
    "is_adapter_name",
    "lora_settings",
    "peft_config_dict",
    "published_names",
    "settings_differ",
    "target_regex",
    "write_adapter_dir",
]

DEFAULT_TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""The language model's attention and MLP projections in every family gymbridge knows (Qwen2/2.5/3-VL,
the Omni thinker, Gemma 3, InternVL's Qwen2 decoder) and in Llama-style decoders generally."""

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""peft's adapter directory: these two files (``PeftModel.from_pretrained``, vLLM's LoRA loader)."""

_SETTINGS_ATTR = "gymbridge_lora"
_ADAPTER_NAME = "default"


class LoRAConfig(StrictModel):
    """``trainer.lora``: LoRA adapters instead of full fine-tuning (``rank: 0``, the default: off)."""

    rank: int = Field(0, ge=0, le=4096)
    """The adapters' rank ``r`` (0: no LoRA, every weight trains)."""
    alpha: float | None = Field(None, gt=0, allow_inf_nan=False)
    """The scale numerator: an adapter adds ``(alpha / rank) * B @ A``. ``None``: ``2 * rank``."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0, allow_inf_nan=False)
    """Dropout on the adapters' inputs in the trainer's gradient pass. The trainer runs the policy in
    eval mode (ratio 1 on-policy): with a dropout > 0 its adapter dropout runs in training mode, so
    the first micro-batch's ratio wanders from 1 by the adapters' share of the output (the drift
    guard's tolerance still applies). The generator never drops anything."""
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    """Last name parts of the ``nn.Linear`` modules of the language model that get adapters."""
    full_modules: tuple[str, ...] = ()
    """Last name parts of language-model modules trained in full beside the adapters (peft's
    ``modules_to_save``, e.g. ``lm_head``): their weights are published and checkpointed in full. None
    by default (a pretrained head needs no training; a full ``lm_head`` is vocabulary x hidden)."""
    vision: Literal["frozen", "full"] = "frozen"
    """The media encoders (vision and audio towers): ``frozen`` (no adapter, no gradient) or ``full``
    (every encoder weight trains and is published in full after each step)."""

    @model_validator(mode="after")
    def _targets_are_names(self) -> LoRAConfig:
        names = (*self.target_modules, *self.full_modules)
        bad = [t for t in names if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t)]
        if set(self.target_modules) & set(self.full_modules):
            raise ValueError(
                f"{sorted(set(self.target_modules) & set(self.full_modules))}: in target_modules (adapters) "
                "and full_modules (full weights): name each in one"
            )
        if bad or (self.rank and not self.target_modules):
            raise ValueError(
                "target_modules and full_modules are module names such as q_proj (no dots, no patterns), "
                f"got {bad or '[]'}"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale_alpha(self) -> float:
        """``alpha`` with its default resolved."""
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank


def target_regex(targets: tuple[str, ...]) -> str:
    """The peft ``target_modules`` pattern: a module whose last name part is one of ``targets`` and
    that lies under no media encoder (a full match on the module's dotted name)."""
    encoders = "|".join(re.escape(n) for n in ENCODER_NAMES)
    names = "|".join(re.escape(t) for t in targets)
    return rf"^(?!(?:.*\.)?(?:{encoders})\.).*(?:^|\.)(?:{names})$"


def peft_config_dict(config: LoRAConfig) -> dict[str, Any]:
    """The adapter's peft settings as JSON (:func:`lora_settings` adds ``vision``)."""
    return {
        "r": config.rank,
        "lora_alpha": config.scale_alpha,
        "lora_dropout": config.dropout,
        "target_modules": target_regex(config.target_modules),
        "bias": "none",
    }


def _peft_config(settings: Mapping[str, Any]) -> Any:
    try:
        from peft import LoraConfig
    except ImportError as exc:  # pragma: no cover - peft is in the train extra
        raise ImportError("trainer.lora needs peft: pip install 'gymbridge[train]'") from exc
    return LoraConfig(
        r=int(settings["r"]),
        lora_alpha=settings["lora_alpha"],
        lora_dropout=float(settings.get("lora_dropout", 0.0)),
        target_modules=str(settings["target_modules"]),
        bias="none",
        init_lora_weights=True,
    )


class LoRAInfo(StrictModel):
    """What :func:`apply_lora` did."""

    adapted_modules: int
    adapter_params: int
    """Parameter elements in the adapters."""
    trainable_params: int
    """Parameter elements the optimizer updates (the adapters, plus the encoders with ``vision: full``)."""
    total_params: int

    def describe(self) -> str:
        share = 100.0 * self.trainable_params / max(1, self.total_params)
        return (
            f"LoRA on {self.adapted_modules} modules: {self.adapter_params:,} adapter params, "
            f"{self.trainable_params:,} of {self.total_params:,} trainable ({share:.2f}%)"
        )


def apply_lora(
    model: torch.nn.Module, settings: LoRAConfig | Mapping[str, Any], *, init_seed: int = 0
) -> LoRAInfo:
    """Inject LoRA adapters into ``model`` in place (module docstring) and freeze everything else.

    ``settings`` is a :class:`LoRAConfig` or a dict of :func:`lora_settings` (a generator's or a
    worker's copy: :func:`peft_config_dict` plus ``vision``, ``frozen`` when absent). The adapters'
    random ``A`` come from ``init_seed`` (the global RNG is left as it was), so a run starts from the
    same adapters every time. A model with adapters already is refused (``ValueError``), as is a
    config that matches no module (the error lists the model's linear layers outside the encoders).
    """
    if has_lora(model):
        raise ValueError(f"{type(model).__name__} already holds LoRA adapters")
    if isinstance(settings, LoRAConfig):
        full = list(settings.full_modules)
        settings = {**peft_config_dict(settings), "vision": settings.vision, "full_modules": full}
    vision = str(settings.get("vision", "frozen"))
    if vision not in ("frozen", "full"):
        raise ValueError(f"LoRA vision must be 'frozen' or 'full', got {vision!r}")
    pattern = re.compile(str(settings["target_modules"]))
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    matched = [n for n in linear if pattern.fullmatch(n)]
    if not matched:
        outside = sorted({n.rsplit(".", 1)[-1] for n in linear if not _under_encoder(n)})
        raise ValueError(
            f"trainer.lora.target_modules matches no linear layer of {type(model).__name__}'s language "
            f"model; its linear layers outside the encoders are named {outside}"
        )
    # everything refusable is refused before peft touches the model
    encoders = encoder_modules(model) if vision == "full" else []
    if vision == "full" and not encoders:
        raise ValueError(f"trainer.lora.vision=full: {type(model).__name__} has no vision or audio encoder")
    in_full = [str(m) for m in settings.get("full_modules") or ()]
    trained_in_full = [
        module
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in in_full and not _under_encoder(name)
    ]
    missing = sorted(
        set(in_full) - {n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if not _under_encoder(n)}
    )
    if missing:
        raise ValueError(f"trainer.lora.full_modules: {type(model).__name__} has no module named {missing}")
    from peft import inject_adapter_in_model

    with torch.random.fork_rng(devices=[]):  # the adapters' random A from init_seed, whatever ran before
        torch.manual_seed(init_seed)
        inject_adapter_in_model(_peft_config(settings), model, adapter_name=_ADAPTER_NAME)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    for module in [*(encoder for _, encoder in encoders), *trained_in_full]:
        for p in module.parameters():
            p.requires_grad_(True)
    setattr(model, _SETTINGS_ATTR, {**dict(settings), "vision": vision, "full_modules": in_full})
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    setattr(model, PUBLISHED_NAMES_ATTR, frozenset(names))
    adapter = sum(p.numel() for n, p in model.named_parameters() if is_adapter_name(n))
    return LoRAInfo(
        adapted_modules=len(matched),
        adapter_params=adapter,
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        total_params=sum(p.numel() for p in model.parameters()),
    )


ADAPTER_STRUCTURE: tuple[str, ...] = ("r", "lora_alpha", "target_modules", "bias", "vision", "full_modules")
"""The settings (:func:`lora_settings`) a model's trained tensors depend on: which exist, their shapes,
their scale. Dropout is not among them: a resumed run may change it."""


def settings_differ(saved: Mapping[str, Any], held: Mapping[str, Any]) -> list[str]:
    """The :data:`ADAPTER_STRUCTURE` keys on which two adapter settings differ (``[]``: the same adapters)."""
    return [k for k in ADAPTER_STRUCTURE if saved.get(k) != held.get(k)]


def _under_encoder(name: str) -> bool:
    """Whether the module ``name`` lies inside a media encoder (:data:`ENCODER_NAMES`)."""
    return any(part in ENCODER_NAMES for part in name.split(".")[:-1])


def has_lora(model: Any) -> bool:
    """Whether :func:`apply_lora` injected adapters into ``model``."""
    return getattr(model, _SETTINGS_ATTR, None) is not None


def lora_settings(model: Any) -> dict[str, Any] | None:
    """The adapter settings ``model`` was injected with (:func:`peft_config_dict` plus ``vision``)."""
    settings = getattr(model, _SETTINGS_ATTR, None)
    return dict(settings) if settings is not None else None


def published_names(model: Any) -> frozenset[str] | None:
    """The state-dict names a LoRA model publishes after a step (its adapters and any tensor it trains
    in full); ``None`` for a model without adapters (every weight is published)."""
    names = getattr(model, PUBLISHED_NAMES_ATTR, None)
    return names if isinstance(names, frozenset) else None


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` as its base model (every LoRA layer bypassed) inside the block.

    Each adapter's ``requires_grad`` is restored on the way out (peft's toggle clears it)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    grads = [(p, p.requires_grad) for n, p in model.named_parameters() if is_adapter_name(n)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, wanted in grads:
            p.requires_grad_(wanted)


def adapter_dropout(model: torch.nn.Module, active: bool) -> int:
    """Put the adapters' dropout modules in training mode (``active``) or eval mode; returns how many.

    The rest of the model keeps its mode (the trainer runs it in eval mode)."""
    count = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 2)[-2:-1] == ["lora_dropout"]:
            module.train(active)
            count += 1
    return count


def adapter_file_name(name: str) -> str:
    """An in-model adapter name as peft's adapter files spell it: ``base_model.model.`` before it and
    the adapter's name (``.default``) out (``x.q_proj.lora_A.default.weight`` ->
    ``base_model.model.x.q_proj.lora_A.weight``)."""
    match = ADAPTER_PATTERN.search(name)
    if match is None:
        raise ValueError(f"{name!r} is not a LoRA adapter tensor's name")
    rest = name[match.end() :]
    if rest.startswith(f"{_ADAPTER_NAME}."):
        rest = rest[len(_ADAPTER_NAME) + 1 :]
    elif rest == _ADAPTER_NAME:
        rest = ""
    return f"base_model.model.{name[: match.end()]}{rest}".rstrip(".")


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s adapter tensors under their adapter-file names (:func:`adapter_file_name`)."""
    return {adapter_file_name(n): t for n, t in model.state_dict().items() if is_adapter_name(n)}


def write_adapter_dir(
    out: str | Path,
    tensors: Mapping[str, torch.Tensor],
    settings: Mapping[str, Any],
    *,
    base_model: str | None = None,
) -> Path:
    """Write a peft adapter directory (``adapter_config.json`` and ``adapter_model.safetensors``).

    ``tensors`` are keyed by adapter-file names (:func:`adapter_file_name`); ``settings`` is
    :func:`peft_config_dict`'s dict. ``PeftModel.from_pretrained(base, out)`` and vLLM's
    ``LoRARequest(lora_path=out)`` load it.
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = {  # peft's LoraConfig fields that its loader and vLLM's read; peft fills the rest
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model,
        "r": int(settings["r"]),
        "lora_alpha": float(settings["lora_alpha"]),
        "lora_dropout": float(settings.get("lora_dropout", 0.0)),
        "target_modules": str(settings["target_modules"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
        str(out / ADAPTER_WEIGHTS),
        metadata={"format": "pt"},
    )
    return out
