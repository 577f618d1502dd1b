"""Helpers the example servers share: typed task-data parsing with FastAPI-shaped 4xx errors.

Invariant: a row missing a key its verifier needs (or holding it with the wrong type) is
refused with HTTP 422 and a ``{"detail": [...]}`` body naming each bad field, never
scored 0.0 in silence (stock circle_click defaults missing task data to reward 0).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gymbridge.server import HttpError, Session

__all__ = ["parse_task", "require_state"]

TaskT = TypeVar("TaskT", bound=BaseModel)


def parse_task(row: dict[str, Any], model: type[TaskT]) -> TaskT:
    """The row's top-level task data validated by ``model``; HTTP 422 when it does not fit."""
    try:
        return model.model_validate(row)
    except ValidationError as exc:
        detail = [
            {"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]}
            for e in exc.errors(include_url=False, include_input=False)
        ]
        raise HttpError(422, {"detail": detail}) from None


def require_state(session: Session, key: str, hint: str) -> Any:
    """``session.state[key]``, or HTTP 409 telling the caller which call is missing."""
    if key not in session.state:
        raise HttpError(409, {"detail": f"no task in this session: {hint}"})
    return session.state[key]
