"""The public API of gymbridge.server / gymbridge.client: one sorted __all__, every name importable."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("module_name", ["gymbridge.server", "gymbridge.client"])
def test_all_is_sorted_and_resolves(module_name: str) -> None:
    module = importlib.import_module(module_name)
    names = list(module.__all__)
    assert names == sorted(names)
    assert len(names) == len(set(names))
    for name in names:
        assert getattr(module, name) is not None, name


def test_stable_names_present() -> None:
    server = importlib.import_module("gymbridge.server")
    client = importlib.import_module("gymbridge.client")
    for name in (
        "ResourcesServer",
        "tool",
        "serve",
        "start_server",
        "check_env",
        "SimpleAgent",
        "VerifyResult",
    ):
        assert name in server.__all__
    for name in ("GymClient", "RolloutOutcome"):
        assert name in client.__all__
