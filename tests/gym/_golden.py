"""Golden files recorded from genuine NeMo Gym 0.7.0 servers (``tests/gym/recorded/*.json``).

Role: record the exact ``/run`` results (and error answers) genuine servers give, so every
gymbridge component can be tested against real 0.7.0 shapes without the gym venv; and compare a
fresh run against the recording, so a drift in genuine behaviour (or in how we drive it) fails.

File format (one scenario per file)::

    {"scenario", "description", "nemo_gym_version", "servers": [...], "script": [...],
     "request": <the /run body>, "status": <HTTP status>, "set_cookie_names": [...],
     "response": <the /run body answered, ids normalised>}

Invariants:
* ids that change every run are normalised: every ``id`` -> ``"<id>"``, ``created_at`` -> ``0``, and
  each distinct ``call_id`` -> ``call_<n>`` in order of first appearance (pairs stay linked);
* token ids and logprobs are kept verbatim in the file (other engineers parse them), but the
  comparison masks them: their values belong to gymbridge's scripted model, not to NeMo Gym;
* recording happens only when ``GYMBRIDGE_RECORD_GOLDEN=1``; otherwise files are only read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RECORDED = Path(__file__).parent / "recorded"
RECORD = os.environ.get("GYMBRIDGE_RECORD_GOLDEN") == "1"
TOKEN_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def normalise(obj: Any) -> Any:
    """Replace per-run ids/timestamps; keep call_id pairing (``call_1`` ... by first appearance)."""
    call_ids: dict[str, str] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out: dict[str, Any] = {}
            for key, value in node.items():
                if key == "id" and isinstance(value, str):
                    out[key] = "<id>"
                elif key == "created_at" and isinstance(value, int | float):
                    out[key] = 0
                elif key == "call_id" and isinstance(value, str):
                    out[key] = call_ids.setdefault(value, f"call_{len(call_ids) + 1}")
                else:
                    out[key] = walk(value)
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(obj)


def mask_tokens(obj: Any) -> Any:
    """The comparison view: token fields become their presence and length consistency only."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            if key in TOKEN_KEYS and isinstance(value, list):
                out[key] = "<non-empty>" if value else "<empty>"
            else:
                out[key] = mask_tokens(value)
        return out
    if isinstance(obj, list):
        return [mask_tokens(v) for v in obj]
    return obj


def golden_path(scenario: str) -> Path:
    return RECORDED / f"{scenario}.json"


def load(scenario: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(golden_path(scenario).read_text())
    return data


def write(scenario: str, record: dict[str, Any]) -> None:
    RECORDED.mkdir(parents=True, exist_ok=True)
    golden_path(scenario).write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")


def check_or_record(scenario: str, record: dict[str, Any]) -> dict[str, Any]:
    """Write ``record`` when recording; else assert it matches the committed golden file.

    Returns the golden record (the one just written when recording).
    """
    record = {**record, "response": normalise(record["response"])}
    if RECORD:
        write(scenario, record)
        return record
    assert golden_path(scenario).exists(), (
        f"no golden file {golden_path(scenario)}: record it with GYMBRIDGE_RECORD_GOLDEN=1"
    )
    golden = load(scenario)
    for key in ("status", "set_cookie_names"):
        assert record[key] == golden[key], f"{scenario}: {key} {record[key]!r} != golden {golden[key]!r}"
    assert mask_tokens(record["response"]) == mask_tokens(golden["response"]), (
        f"{scenario}: genuine /run result drifted from {golden_path(scenario)} "
        "(rerun with GYMBRIDGE_RECORD_GOLDEN=1 if the change is intended)"
    )
    return golden
