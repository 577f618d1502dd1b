"""The README's library example runs as printed: its environment class, then its ``train`` call.

Only what cannot run offline is swapped: the model directory becomes the tiny offline model and the
run is one step of 2 rollouts (text substitutions on the README's own code, checked to apply).
"""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from gymbridge.media import encode_data_url

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _png(colour: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (56, 56), colour).save(out, format="PNG")
    return out.getvalue()


def test_the_readme_library_example_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_code, train_code = _python_blocks()[:2]
    assert env_code.startswith("# my_env.py\n")
    (tmp_path / "my_env.py").write_text(env_code)
    rows = [
        {
            "responses_create_params": {"input": [{"role": "user", "content": "Which door? Look first."}]},
            "png": encode_data_url(_png(colour), "image/png"),
            "door": colour,
        }
        for colour in ("red", "blue")
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    swaps = {
        '"./qwen2-vl-2b"': '"tiny"',
        '"steps": 200': '"steps": 1',
        '"group_size": 8, "prompts_per_step": 16': '"group_size": 2, "prompts_per_step": 1',
    }
    for old, new in swaps.items():
        assert old in train_code, old
        train_code = train_code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict[str, Any] = {}
    try:
        exec(compile(train_code, "README.md", "exec"), namespace)  # the README's own code
    finally:
        sys.modules.pop("my_env", None)
    summary = namespace["summary"]
    assert len(summary.env_rewards) == 1 and summary.rollouts_ok == 2 and summary.rollouts_failed == 0
    assert Path(summary.run_dir).resolve().parent == (tmp_path / "runs").resolve()
