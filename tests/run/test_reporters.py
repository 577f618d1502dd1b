"""``report_to``: the metrics records reach wandb / tensorboard; a missing package names its extra."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import orjson
import pytest
from run_helpers import SMALL, quiet_train, run_config

from gymbridge.errors import ConfigError
from gymbridge.run.reporters import flat_scalars, open_reporters


def test_flat_scalars_keeps_numbers_and_flattens_payload() -> None:
    rec = {
        "step": 3,
        "loss": 0.5,
        "ok": True,
        "keys": ["a"],
        "x": None,
        "payload": {"b": {"serialized_bytes": 7}},
    }
    assert flat_scalars(rec) == {"step": 3.0, "loss": 0.5, "ok": 1.0, "payload.b.serialized_bytes": 7.0}


@pytest.mark.parametrize(("name", "module"), [("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_a_missing_reporter_names_its_extra(
    name: str, module: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=rf"gymbridge\[{name}\]"):
        open_reporters([name], tmp_path, {})  # type: ignore[list-item]


@pytest.mark.integration
def test_wandb_gets_every_step_record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    logged: list[tuple[int, dict[str, float]]] = []
    finished: list[bool] = []

    class FakeRun:
        def log(self, data: dict[str, float], step: int) -> None:
            logged.append((step, data))

        def finish(self) -> None:
            finished.append(True)

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: FakeRun()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    quiet_train(run_config(tmp_path, {**SMALL, "output.report_to": ["wandb"]}))
    records = [orjson.loads(x) for x in (tmp_path / "metrics.jsonl").read_bytes().splitlines()]
    assert [s for s, _ in logged] == [1, 2]
    for (_, data), rec in zip(logged, records, strict=True):
        assert data == flat_scalars(rec) and data["loss"] == rec["loss"]
    assert finished == [True]
