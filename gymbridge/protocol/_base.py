"""Base class of every wire model, and the token-field mixin.

Invariants every wire model keeps:

* **Lenient on input.** ``extra="allow"``: keys we do not model are kept in
  ``model_extra`` and written back unchanged. Keys that were absent stay absent on
  dump (dumps use ``exclude_unset``), so ``dump(parse(x)) == x``.
* **Strict on output.** A model built in Python (not parsed from the wire) marks
  the fields NeMo Gym needs to see as set, so they are always written (``type`` on
  every item and part, ``detail`` on images, ids on assistant messages …), and may
  fill generated defaults (ids, timestamps). Parsing goes through the helpers in
  :mod:`gymbridge.protocol._codec`, which pass a validation context that turns this
  off, so parsed data is written back exactly as it came.
* **Token fields** (``prompt_token_ids``, ``generation_token_ids``,
  ``generation_log_probs``; optional ``routed_experts``) are all present or all
  absent; ids are JSON integers and log probabilities JSON numbers (no coercion from
  strings or booleans); ``len(generation_log_probs) == len(generation_token_ids)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Strict, ValidationInfo, model_validator

__all__ = ["TOKEN_FIELDS", "TokenFields", "WireModel", "is_wire_context"]

#: Validation context passed by the parse helpers: "this came from the wire, keep it verbatim".
WIRE_CONTEXT: Mapping[str, Any] = {"gymbridge.wire": True}

#: The three token fields NeMo Gym's model servers attach in training mode (all or none).
TOKEN_FIELDS: tuple[str, str, str] = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")

TokenId = Annotated[int, Strict()]
LogProb = Annotated[float, Strict()]


def is_wire_context(context: object) -> bool:
    """True when a validation runs on behalf of a parse helper (data from the wire)."""
    return isinstance(context, Mapping) and bool(context.get("gymbridge.wire"))


class WireModel(BaseModel):
    """Base of all gymbridge wire models: extra keys kept, absent keys stay absent."""

    model_config = ConfigDict(
        extra="allow",
        populate_by_name=True,
        serialize_by_alias=True,
        protected_namespaces=(),
    )

    #: Fields written even when left at their default, for models built in Python.
    _emit_fields: ClassVar[tuple[str, ...]] = ()
    #: Generated defaults (e.g. ids) filled in for models built in Python when absent.
    _emit_factories: ClassVar[Mapping[str, Callable[[], Any]]] = {}

    @model_validator(mode="after")
    def _complete_for_output(self, info: ValidationInfo) -> Self:
        if is_wire_context(info.context):
            self._untangle_extra_names()
            return self
        for name, factory in self._emit_factories.items():
            if name not in self.model_fields_set and getattr(self, name) is None:
                setattr(self, name, factory())
        if self._emit_fields or self._emit_factories:
            self.__pydantic_fields_set__.update(self._emit_fields)
            self.__pydantic_fields_set__.update(self._emit_factories)
        self._check_output()
        return self

    def _untangle_extra_names(self) -> None:
        # pydantic records extra keys in the fields set by name; an extra key spelled like an
        # aliased field (a dataset column ``task_index`` beside ``_ng_task_index``) would then
        # mark that field as set and write a spurious ``_ng_task_index: null``.
        extra = self.__pydantic_extra__
        if not extra:
            return
        for name, field in type(self).model_fields.items():
            if (
                field.alias
                and field.alias != name
                and name in extra
                and getattr(self, name) == field.get_default(call_default_factory=True)
            ):
                self.__pydantic_fields_set__.discard(name)

    def _check_output(self) -> None:
        """Hook: extra checks for models built in Python (raise ``ValueError``)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: aliases, set fields and extras only (the exact wire shape)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    def to_json(self) -> bytes:
        """UTF-8 JSON bytes of :meth:`to_dict`, serialised in Rust (no intermediate dict)."""
        return type(self).__pydantic_serializer__.to_json(self, by_alias=True, exclude_unset=True)


class TokenFields(WireModel):
    """Training-mode token fields a model server attaches to the last output item of a call.

    ``prompt_token_ids`` is the full prompt of that model call; ``generation_token_ids``
    and ``generation_log_probs`` (same length) are what it sampled. ``routed_experts``
    (MoE routing, opaque to gymbridge) is kept verbatim when present.
    """

    prompt_token_ids: list[TokenId] | None = None
    generation_token_ids: list[TokenId] | None = None
    generation_log_probs: list[LogProb] | None = None
    routed_experts: str | list[list[list[TokenId]]] | None = None

    @model_validator(mode="after")
    def _check_token_fields(self, info: ValidationInfo) -> Self:
        if not is_wire_context(info.context):
            # Built in Python: ``prompt_token_ids=None`` means "no token fields".
            for name in (*TOKEN_FIELDS, "routed_experts"):
                if getattr(self, name) is None:
                    self.__pydantic_fields_set__.discard(name)
        present = [name for name in (*TOKEN_FIELDS, "routed_experts") if name in self.model_fields_set]
        if not present:
            return self
        missing = [name for name in TOKEN_FIELDS if name not in present]
        if missing:
            raise ValueError(
                f"token fields must come together: has {', '.join(present)} "
                f"but is missing {', '.join(missing)}"
            )
        nulls = [name for name in TOKEN_FIELDS if getattr(self, name) is None]
        if nulls:
            raise ValueError(f"token fields must be lists, got null for {', '.join(nulls)}")
        assert self.generation_token_ids is not None and self.generation_log_probs is not None
        if len(self.generation_log_probs) != len(self.generation_token_ids):
            raise ValueError(
                f"generation_log_probs has {len(self.generation_log_probs)} entries but "
                f"generation_token_ids has {len(self.generation_token_ids)}; they must be equally long"
            )
        return self

    @property
    def has_token_fields(self) -> bool:
        """True when this item carries the training token fields (validated complete)."""
        return self.generation_token_ids is not None

    def drop_token_fields(self) -> Self:
        """A copy without token fields (e.g. to replay an item to a server that rejects them)."""
        data = self.to_dict()
        for name in (*TOKEN_FIELDS, "routed_experts"):
            data.pop(name, None)
        return type(self).model_validate(data, context=WIRE_CONTEXT, by_alias=True, by_name=False)
