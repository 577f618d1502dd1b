"""Helpers shared by the example environments: seeding, encoding, row I/O, answer parsing.

Invariants:

* every generator derives one ``random.Random`` per row from ``(env name, seed, index)``
  (:func:`row_rng`), so row ``i`` of ``generate(n, seed)`` is the same whatever ``n`` is,
  and the same in every process (string seeds hash through SHA-512, not ``hash()``);
* media encoders are deterministic: the same scene gives the same bytes, hence the same
  content key downstream;
* rows follow the stock NeMo Gym row shape: ``responses_create_params`` holds only keys
  the Responses API knows (``input``, ``tools``, ``metadata``); everything a verifier needs
  rides at the row's top level;
* answer parsers never raise on model output: unparseable output is "no answer" (``None``).
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson
from PIL import Image

from gymbridge.media import encode_data_url

logger = logging.getLogger(__name__)

__all__ = [
    "assistant_text",
    "count_reward",
    "first_call_arguments",
    "function_calls",
    "parse_int_answer",
    "png_bytes",
    "png_data_url",
    "row_rng",
    "write_jsonl",
]

JsonDict = dict[str, Any]


def row_rng(env_name: str, seed: int, index: int) -> random.Random:
    """The random generator of row ``index`` of a dataset generated with ``seed``."""
    return random.Random(f"gymbridge/{env_name}/{seed}/{index}")


def png_bytes(image: Image.Image) -> bytes:
    """Deterministic PNG encoding (no timestamps or text chunks are written by Pillow)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def png_data_url(image: Image.Image) -> str:
    return encode_data_url(png_bytes(image), "image/png")


def write_jsonl(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> int:
    """Write ``rows`` as JSON lines atomically (temp file + rename); return the row count.

    A crash mid-write leaves any previous file at ``path`` untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    count = 0
    try:
        with os.fdopen(fd, "wb") as fh:
            for row in rows:
                fh.write(orjson.dumps(row))
                fh.write(b"\n")
                count += 1
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    logger.debug("wrote %d rows to %s", count, target)
    return count


def _items(output: object) -> list[Mapping[str, Any]]:
    if not isinstance(output, list):
        return []
    return [item for item in output if isinstance(item, Mapping)]


def function_calls(output: object, name: str) -> list[JsonDict | None]:
    """Arguments of every ``function_call`` item named ``name``, in order.

    An entry is ``None`` where the arguments are not a JSON object (the call still
    happened; a verifier decides what that is worth).
    """
    calls: list[JsonDict | None] = []
    for item in _items(output):
        if item.get("type") != "function_call" or item.get("name") != name:
            continue
        raw = item.get("arguments")
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except (json.JSONDecodeError, TypeError):
            args = None
        calls.append(args if isinstance(args, dict) else None)
    return calls


def first_call_arguments(output: object, name: str) -> JsonDict | None:
    """Arguments of the first ``name`` call (``None`` when absent or not a JSON object)."""
    calls = function_calls(output, name)
    return calls[0] if calls else None


def assistant_text(output: object) -> str:
    """All assistant ``output_text`` of ``response.output``, joined by newlines."""
    parts: list[str] = []
    for item in _items(output):
        if item.get("type", "message") != "message" or item.get("role", "assistant") != "assistant":
            continue
        content = item.get("content")
        if isinstance(content, str):
            parts.append(content)
            continue
        for part in content if isinstance(content, list) else []:
            if isinstance(part, Mapping) and part.get("type") == "output_text":
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
    return "\n".join(parts)


_WORD = re.compile(r"[a-z]+")


def first_word(text: str) -> str | None:
    """The first run of ASCII letters in ``text``, lower-case (``None`` when there is none)."""
    m = _WORD.search(text.lower())
    return m.group(0) if m else None


_ANSWER_TAG = re.compile(r"<answer>\s*(-?\d+)\s*</answer>", re.IGNORECASE)
_INTEGER = re.compile(r"(?<![\w.])-?\d+(?!\w|\.\d)")


def _as_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    return None


def count_reward(expected: int, answered: int | None) -> float:
    """1.0 for the exact count, else 0.0 (no answer: 0.0). Shared by every counting environment."""
    return 1.0 if answered is not None and answered == expected else 0.0


def parse_int_answer(output: object, *, tool: str = "answer", arg: str = "count") -> int | None:
    """The integer the model answered, from ``response.output``.

    Precedence: the first ``tool`` call (its ``arg``), else the last ``<answer>N</answer>``
    in the assistant text, else the last standalone integer of the assistant text. A call
    whose argument is not an integer counts as a (wrong) answer: ``None``.
    """
    calls = function_calls(output, tool)
    if calls:
        args = calls[0]
        return _as_int(args.get(arg)) if args is not None else None
    text = assistant_text(output)
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return int(tagged[-1])
    bare = _INTEGER.findall(text)
    return int(bare[-1]) if bare else None
