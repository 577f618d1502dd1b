"""The peers' tool-call parsers, run in their own venvs by ``test_tool_parsers.py``.

``python _tool_parser_peers.py gym``  (``.venv-gym``): genuine nemo-gym 0.7.0's
``resources_servers.image_tools.base.parse_image_tool_calls`` and ``has_malformed_image_tool_markup``;
``python _tool_parser_peers.py vllm`` (``.venv-vllm``, the repository on ``PYTHONPATH``): vLLM's
``qwen3_coder`` and ``hermes`` tool parsers over the tiny Qwen tokenizer, on CPU.

Reads ``[{"format", "text", "tools"}, ...]`` as JSON on stdin; prints one JSON line:
``[{"calls": [[name, arguments], ...], "content": ..., "malformed": ...}, ...]``.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def gym(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from resources_servers.image_tools.base import (  # type: ignore[import-not-found]
        has_malformed_image_tool_markup,
        parse_image_tool_calls,
    )

    return [
        {
            "calls": [[c["name"], c["arguments"]] for c in parse_image_tool_calls(case["text"])],
            "content": None,
            "malformed": has_malformed_image_tool_markup(case["text"]),
        }
        for case in cases
    ]


def vllm(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from vllm.entrypoints.openai.chat_completion.protocol import (  # type: ignore[import-not-found]
        ChatCompletionRequest,
    )
    from vllm.tool_parsers import ToolParserManager  # type: ignore[import-not-found]

    from gymbridge.models.tiny_vlm import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    out = []
    for case in cases:
        request = ChatCompletionRequest(
            model="tiny", messages=[{"role": "user", "content": "hi"}], tools=case["tools"] or None
        )
        parser = ToolParserManager.get_tool_parser(case["format"])(tokenizer, tools=request.tools)
        info = parser.extract_tool_calls(case["text"], request)
        out.append(
            {
                "calls": [[c.function.name, json.loads(c.function.arguments)] for c in info.tool_calls],
                "content": info.content,
                "malformed": None,
            }
        )
    return out


if __name__ == "__main__":
    peer = {"gym": gym, "vllm": vllm}[sys.argv[1]]
    print(json.dumps(peer(json.load(sys.stdin))))
