"""The flat public API of gymbridge.protocol: one sorted ``__all__``, every name real, no nemo_gym."""

from __future__ import annotations

import re
from pathlib import Path

import gymbridge.protocol as protocol


def _isort_key(name: str) -> tuple[int, str]:
    # ruff RUF022 ("isort-style"): CONSTANTS, then Classes, then functions
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return (kind, name)


def test_all_is_sorted_and_unique() -> None:
    assert protocol.__all__ == sorted(protocol.__all__, key=_isort_key)
    assert len(set(protocol.__all__)) == len(protocol.__all__)


def test_every_public_name_exists_and_nothing_public_is_missing() -> None:
    for name in protocol.__all__:
        assert getattr(protocol, name) is not None, name
    public = {n for n in vars(protocol) if not n.startswith("_") and n != "annotations"}
    modules = {n for n in public if type(getattr(protocol, n)).__name__ == "module"}
    assert public - modules == set(protocol.__all__)


def test_protocol_never_imports_nemo_gym() -> None:
    package = Path(protocol.__file__).parent
    for source in package.glob("*.py"):
        assert not re.search(r"^\s*(from|import)\s+nemo_gym", source.read_text(), re.M), source.name
