""":mod:`gymbridge.models.tiny_vlm` under its ``gymbridge.testing`` name (tests, TRL helpers).

Every name of the product module resolves here to the same object (the public ones through
``import *``, the rest through :func:`__getattr__`); new code imports ``gymbridge.models.tiny_vlm``.
"""

from __future__ import annotations

from typing import Any

from gymbridge.models import tiny_vlm as _product
from gymbridge.models.tiny_vlm import *  # noqa: F403  (a re-export: the product module's __all__)
from gymbridge.models.tiny_vlm import __all__ as __all__


def __getattr__(name: str) -> Any:
    return getattr(_product, name)
