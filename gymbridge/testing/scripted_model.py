"""ScriptedModelServer: a test double of NeMo Gym's model server in training mode.

It answers ``POST /v1/responses`` and ``POST /v1/chat/completions`` the way
``responses_api_models/vllm_model`` does with ``return_token_id_information``
on, but from a *script* instead of a model, so agents, clients and the
trajectory layer can be tested offline and deterministically.

The script is a list of outputs (the k-th model call of a conversation gets
entry k; calls past the end repeat the last entry) or a callable
``(request_json) -> output``. An output is one of:

* a ``str``: one assistant message;
* a dict ``{"text"?, "reasoning"?, "calls"?: [{"name", "arguments"}], "incomplete"?,
  "status"?, "body"?, "delay_s"?}``: ``reasoning`` becomes a ``reasoning`` item,
  ``calls`` become ``function_call`` items (``arguments`` a dict or a raw
  string, which lets tests send non-JSON arguments), ``incomplete`` sets
  ``incomplete_details={"reason": "max_output_tokens"}``, ``status``/``body``
  answer with that HTTP error instead, ``delay_s`` sleeps first (hang tests).

Token fields (invariants the trajectory layer relies on):

* ``prompt_token_ids``, ``generation_token_ids`` and ``generation_log_probs``
  sit on the **last output item of each call** only;
* a call's prompt is the ``prompt_token_ids + generation_token_ids`` of the
  latest replayed item that carries them, followed by tokens for every input
  item after it: prompts extend contiguously, so trajectories parse;
* every image part in the new input contributes exactly ``image_token_id``
  once (override ``tokenize`` to emit a real processor's placeholders);
* ``len(generation_log_probs) == len(generation_token_ids) > 0``.

``call_index(request_json)`` (the number of earlier model calls in the
conversation) is exported for callable scripts. Every request body is kept in
``server.requests`` and its path as sent (``/ng-rollout/<id>/...`` prefix
included) in ``server.request_paths``, so tests can assert what an agent sent.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from gymbridge.server._base import GymServer, RequestContext, RunningServer, json_response, start_server

__all__ = ["ScriptEntry", "ScriptedModelServer", "call_index", "fake_tokenize"]

logger = logging.getLogger(__name__)

ScriptEntry = str | dict[str, Any]
Script = Sequence[ScriptEntry] | Callable[[dict[str, Any]], ScriptEntry]
Tokenizer = Callable[[list[Any]], list[int]]

VOCAB_SIZE = 32_000
ASSISTANT_START_TOKEN = 3
IMAGE_TOKEN_ID = 151_655
AUDIO_TOKEN_ID = 151_646
VIDEO_TOKEN_ID = 151_656


def _word_id(word: str) -> int:
    digest = hashlib.blake2b(word.encode(), digest_size=4).digest()
    return 10 + int.from_bytes(digest, "big") % (VOCAB_SIZE - 10)


def _text_ids(text: str) -> list[int]:
    return [_word_id(w) for w in text.split()] or [4]


def fake_tokenize(items: list[Any]) -> list[int]:
    """Deterministic stand-in tokenizer: one id per whitespace word, one per media part."""
    ids: list[int] = []
    for item in items:
        if isinstance(item, str):
            ids.extend(_text_ids(item))
            continue
        if not isinstance(item, dict):
            ids.extend(_text_ids(str(item)))
            continue
        ids.append(_word_id(f"<|{item.get('role') or item.get('type') or 'item'}|>"))
        content = item.get("content", item.get("output", item.get("arguments")))
        if isinstance(content, str):
            ids.extend(_text_ids(content))
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    continue
                kind = str(part.get("type", ""))
                if kind in ("input_image", "image_url"):
                    ids.append(IMAGE_TOKEN_ID)
                elif kind in ("input_audio", "audio_url"):
                    ids.append(AUDIO_TOKEN_ID)
                elif kind in ("input_video", "video_url"):
                    ids.append(VIDEO_TOKEN_ID)
                else:
                    ids.extend(_text_ids(str(part.get("text", ""))))
        for key in ("summary",):
            for part in item.get(key) or []:
                if isinstance(part, dict):
                    ids.extend(_text_ids(str(part.get("text", ""))))
    return ids


def _has_tokens(item: Any) -> bool:
    return isinstance(item, dict) and bool(item.get("generation_token_ids"))


def call_index(request_json: dict[str, Any]) -> int:
    """How many model calls came before this one in the conversation."""
    items = request_json.get("input", request_json.get("messages"))
    if not isinstance(items, list):
        return 0
    return sum(1 for item in items if _has_tokens(item))


class ScriptedModelServer(GymServer):
    """NeMo Gym model-server double (training mode) answering from a script."""

    def __init__(
        self,
        script: Script,
        *,
        model: str = "scripted-model",
        tokenize: Tokenizer = fake_tokenize,
        instance_name: str = "policy_model",
        keep_requests: bool = True,
    ) -> None:
        super().__init__(instance_name=instance_name)
        self.script = script
        self.model = model
        self.tokenize = tokenize
        self.requests: list[dict[str, Any]] = []
        self.request_paths: list[str] = []
        self.keep_requests = keep_requests
        """Record every request body and path (for assertions); off for long or out-of-process runs."""
        self.num_calls = 0
        self._running: RunningServer | None = None
        for prefix in ("", "/training-token-capture"):  # genuine agents may add the capture segment
            self.add_route("POST", f"{prefix}/v1/responses", self._responses)
            self.add_route("POST", f"{prefix}/v1/chat/completions", self._chat)

    # ----------------------------------------------------------- lifecycle
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` in this loop (``port=0``: a free one); returns the base URL."""
        self._running = await start_server(self, host, port)
        return self._running.url

    async def stop(self) -> None:
        if self._running is not None:
            await self._running.stop()
            self._running = None

    @property
    def url(self) -> str:
        if self._running is None:
            raise RuntimeError("ScriptedModelServer is not started")
        return self._running.url

    async def __aenter__(self) -> ScriptedModelServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------- script
    def _entry(self, body: dict[str, Any]) -> dict[str, Any]:
        if callable(self.script):
            entry = self.script(body)
        else:
            if not self.script:
                raise ValueError("empty script")
            entry = self.script[min(call_index(body), len(self.script) - 1)]
        if isinstance(entry, str):
            return {"text": entry}
        if not isinstance(entry, dict):
            raise TypeError(f"script entry must be a str or dict, got {type(entry).__name__}")
        return entry

    def _prompt_ids(self, items: list[Any], preamble: list[Any]) -> list[int]:
        last = max((i for i, item in enumerate(items) if _has_tokens(item)), default=-1)
        if last < 0:
            prefix: list[int] = self.tokenize(preamble) if preamble else []
        else:
            prefix = list(items[last].get("prompt_token_ids") or []) + list(
                items[last]["generation_token_ids"]
            )
        return [*prefix, *self.tokenize(items[last + 1 :]), ASSISTANT_START_TOKEN]

    @staticmethod
    def _generation(text: str, salt: int) -> tuple[list[int], list[float]]:
        ids = _text_ids(text) if text else [2]
        return ids, [-0.05 * (1 + (salt + i) % 7) for i in range(len(ids))]

    async def _common(self, ctx: RequestContext) -> tuple[dict[str, Any], dict[str, Any]] | web.Response:
        body = await ctx.json_object()
        if self.keep_requests:
            self.requests.append(body)
            self.request_paths.append(ctx.request.path)
        self.num_calls += 1
        entry = self._entry(body)
        delay = float(entry.get("delay_s", 0) or 0)
        if delay > 0:
            await asyncio.sleep(delay)
        if "status" in entry:
            return json_response(entry.get("body", "scripted failure"), status=int(entry["status"]))
        return body, entry

    # ------------------------------------------------------- /v1/responses
    async def _responses(self, ctx: RequestContext) -> web.StreamResponse:
        got = await self._common(ctx)
        if isinstance(got, web.Response):
            return got
        body, entry = got
        items = body.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items, "type": "message"}]
        if not isinstance(items, list):
            return json_response({"detail": "input must be a string or a list"}, status=422)
        preamble: list[Any] = [body["instructions"]] if isinstance(body.get("instructions"), str) else []
        prompt = self._prompt_ids(items, preamble)
        output: list[dict[str, Any]] = []
        generated_text: list[str] = []
        if entry.get("reasoning"):
            output.append(
                {
                    "id": f"rs_{uuid.uuid4().hex}",
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": str(entry["reasoning"])}],
                    "status": "completed",
                }
            )
            generated_text.append(f"<think> {entry['reasoning']} </think>")
        if entry.get("text") is not None or (not entry.get("calls") and not entry.get("reasoning")):
            text = str(entry.get("text") or "")
            output.append(
                {
                    "id": f"msg_{uuid.uuid4().hex}",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            )
            generated_text.append(text)
        for call in entry.get("calls") or []:
            arguments = call.get("arguments", {})
            arguments_text = arguments if isinstance(arguments, str) else json.dumps(arguments)
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            output.append(
                {
                    "id": f"fc_{uuid.uuid4().hex}",
                    "type": "function_call",
                    "call_id": call_id,
                    "name": str(call["name"]),
                    "arguments": arguments_text,
                    "status": "completed",
                }
            )
            generated_text.append(f"<tool_call> {call['name']} {arguments_text} </tool_call>")
        gen_ids, logprobs = self._generation(" ".join(generated_text), len(prompt))
        output[-1].update(
            {"prompt_token_ids": prompt, "generation_token_ids": gen_ids, "generation_log_probs": logprobs}
        )
        incomplete = bool(entry.get("incomplete"))
        response = {
            "id": f"resp_{uuid.uuid4().hex}",
            "created_at": time.time(),
            "model": body.get("model") or self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata"),
            "instructions": body.get("instructions"),
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": {
                "input_tokens": len(prompt),
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": len(gen_ids),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(prompt) + len(gen_ids),
            },
        }
        return json_response(response)

    # ------------------------------------------------- /v1/chat/completions
    async def _chat(self, ctx: RequestContext) -> web.StreamResponse:
        got = await self._common(ctx)
        if isinstance(got, web.Response):
            return got
        body, entry = got
        messages = body.get("messages")
        if not isinstance(messages, list):
            return json_response({"detail": "messages must be a list"}, status=422)
        prompt = self._prompt_ids(messages, [])
        content = ""
        if entry.get("reasoning"):
            content += f"<think>{entry['reasoning']}</think>"
        content += str(entry.get("text") or "")
        tool_calls = []
        for call in entry.get("calls") or []:
            arguments = call.get("arguments", {})
            tool_calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": str(call["name"]),
                        "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                    },
                }
            )
        gen_ids, logprobs = self._generation(
            content + json.dumps(tool_calls) if tool_calls else content, len(prompt)
        )
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content or None,
            "prompt_token_ids": prompt,
            "generation_token_ids": gen_ids,
            "generation_log_probs": logprobs,
        }
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = "length" if entry.get("incomplete") else ("tool_calls" if tool_calls else "stop")
        return json_response(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model") or self.model,
                "choices": [{"index": 0, "finish_reason": finish, "message": message, "logprobs": None}],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(gen_ids),
                    "total_tokens": len(prompt) + len(gen_ids),
                },
            }
        )


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m gymbridge.testing.scripted_model --port P --script FILE`` (JSON list of entries)."""
    from gymbridge.server._base import serve

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--script", type=Path, required=True, help="JSON file: a list of script entries")
    parser.add_argument("--model", default="scripted-model")
    args = parser.parse_args(argv)
    script = json.loads(args.script.read_text())
    if not isinstance(script, list) or not script:
        parser.error(f"{args.script}: expected a non-empty JSON list of script entries")
    logging.basicConfig(level=logging.INFO)
    # Out of process nobody can read ``.requests``: keeping them would only grow the heap.
    server = ScriptedModelServer(script, model=args.model, keep_requests=False)
    serve(server, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
