"""The model server: an aiohttp app over any ``Generator``, speaking NeMo Gym's model protocol.

Training mode, as genuine NeMo Gym 0.7.0 expects of a model server:

* ``POST /v1/responses`` — Responses API in, Responses API out; the last output item
  of the call carries ``prompt_token_ids``, ``generation_token_ids`` and
  ``generation_log_probs``; ``finish_reason == "length"`` becomes
  ``status: "incomplete"`` with ``incomplete_details: {"reason": "max_output_tokens"}``;
  a prompt over the context window is answered with an empty incomplete response.
* ``POST /v1/chat/completions`` — what genuine ``vllm_model`` sends to a vLLM
  server. The answer has vLLM's shape: top-level ``prompt_token_ids``,
  ``choices[0].token_ids``, ``logprobs.content[].token == "token_id:<id>"`` (with
  ``return_tokens_as_token_ids``), tool calls under ``message.tool_calls``,
  reasoning under ``reasoning_content`` / ``reasoning`` (``reasoning_parser=True``,
  like vLLM started with ``--reasoning-parser``). A prompt over the context window
  gets vLLM's HTTP 400 (``"This model's maximum context length is N tokens..."``),
  which ``vllm_model`` turns into an empty ``length`` completion.
* ``POST /tokenize`` (vLLM's shape: ``{count, max_model_len, tokens}``),
  ``GET /v1/models``, and ``GET /``, ``/health``, ``/livez``, ``/healthz``,
  ``/readyz``. Paths may arrive prefixed ``/ng-rollout/<id>``.

Invariants: prompts are built by :meth:`ChatCodec.render` only (exact prefix
splice of the latest replayed assistant tokens); media go through ``load_media``
under the server's ``MediaPolicy``; ``n`` must be 1; concurrent requests are
batched into the generator (:class:`BatchingGenerator`, unless the backend batches
concurrent calls itself, like vLLM); every bad request gets a
4xx JSON error body ``{"object": "error", "message", "type", "param", "code"}``
and is logged, never a crash; unexpected failures are a 500 with the same shape.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gymbridge.errors import MediaError, MediaFetchError, ProtocolError
from gymbridge.generation.batching import BatchingGenerator, needs_batching
from gymbridge.generation.chat import (
    ChatCodec,
    ChatMessage,
    chat_to_messages,
    responses_to_messages,
    responses_tools_to_chat,
)
from gymbridge.generation.outputs import chat_message, response_items
from gymbridge.generation.types import ContextLengthError, Generation, Generator, SamplingConfig
from gymbridge.trajectory.refresh import ConversationHistory, build_generation_input
from gymbridge.trajectory.types import GenerationInput

if TYPE_CHECKING:
    from gymbridge.media import MediaPolicy

logger = logging.getLogger(__name__)

__all__ = ["ModelServer", "ModelServerConfig"]

_ROLLOUT_PREFIX = re.compile(r"^/ng-rollout/[^/]+")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _BadRequest(Exception):
    def __init__(self, message: str, *, status: int = 400, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _error(message: str, *, status: int, kind: str) -> web.Response:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _json(data: Any) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


@dataclass(frozen=True, slots=True)
class ModelServerConfig:
    """Server settings. ``default_max_tokens`` applies when a request names no limit."""

    model_name: str = "gymbridge-model"
    max_model_len: int = 4096
    default_max_tokens: int = 1024
    reasoning_parser: bool = True
    batching: bool = True
    max_batch_size: int = 64
    batch_window_s: float = 0.002


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _BadRequest(f"'{key}' must be a number")
    return float(value)


def _chat_tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise _BadRequest("'tools' must be a list of objects")
    return [dict(t) for t in tools]


def _template_kwargs(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise _BadRequest("'chat_template_kwargs' must be an object")
    return kwargs


def _int_or_none(body: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise _BadRequest(f"'{key}' must be an integer")
        return value
    return None


class ModelServer:
    """An aiohttp model server over ``generator``; see the module docstring.

    ``codec`` defaults to ``generator.codec``; ``media_policy`` (default
    ``MediaPolicy()``) governs every media part of every request.
    """

    def __init__(
        self,
        generator: Generator,
        *,
        codec: ChatCodec | None = None,
        config: ModelServerConfig | None = None,
        media_policy: MediaPolicy | None = None,
    ) -> None:
        codec = codec if codec is not None else getattr(generator, "codec", None)
        if not isinstance(codec, ChatCodec):
            raise ValueError("the model server needs a ChatCodec: pass codec= or use a generator with .codec")
        # a copy: the server's reasoning-parser setting must not change the generator's codec,
        # which native rollouts over the same generator also use
        self.codec = copy.copy(codec)
        self.config = config or ModelServerConfig(
            model_name=str(getattr(generator, "model_name", "gymbridge-model")),
            max_model_len=int(getattr(generator, "max_model_len", 4096)),
            reasoning_parser=codec.reasoning_parser,
        )
        self.codec.reasoning_parser = self.config.reasoning_parser
        self.generator: Generator = (
            BatchingGenerator(
                generator, max_batch_size=self.config.max_batch_size, window_s=self.config.batch_window_s
            )
            if self.config.batching and needs_batching(generator)
            else generator
        )
        if media_policy is None:
            from gymbridge.media import MediaPolicy

            media_policy = MediaPolicy()
        self.media_policy = media_policy
        self._runner: web.AppRunner | None = None
        self.url: str | None = None
        self._routes: dict[tuple[str, str], Handler] = {
            ("GET", "/"): self._health,
            ("GET", "/health"): self._health,
            ("GET", "/livez"): self._health,
            ("GET", "/healthz"): self._health,
            ("GET", "/readyz"): self._health,
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/chat/completions"): self._chat_completions,
            ("POST", "/v1/responses"): self._responses,
            ("POST", "/tokenize"): self._tokenize,
        }

    # ------------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_cleanup(self, _app: web.Application) -> None:
        if isinstance(self.generator, BatchingGenerator):
            await self.generator.aclose()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0 = a free port); return the base URL (without ``/v1``)."""
        from gymbridge.server._base import bind_error, check_port

        check_port(port)
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise bind_error(host, port, exc) from exc
        self._runner = runner
        addresses = runner.addresses
        bound = int(addresses[0][1]) if addresses else port
        self.url = f"http://{host}:{bound}"
        logger.info("model server %s listening on %s", self.config.model_name, self.url)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ModelServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ dispatch

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = _ROLLOUT_PREFIX.sub("", request.path) or "/"
        handler = self._routes.get((request.method, path))
        if handler is None:
            if any(p == path for _, p in self._routes):
                return _error(
                    f"method {request.method} not allowed on {path}", status=405, kind="MethodNotAllowed"
                )
            return _error(f"no route {path}", status=404, kind="NotFoundError")
        try:
            return await handler(request)
        except _BadRequest as exc:
            logger.info("%s %s -> %d: %s", request.method, path, exc.status, exc)
            return _error(str(exc), status=exc.status, kind=exc.kind)
        except ContextLengthError as exc:
            return _error(str(exc), status=400, kind="BadRequestError")
        except MediaFetchError as exc:
            status = 503 if exc.retryable else 400
            return _error(f"media: {exc}", status=status, kind="MediaFetchError")
        except MediaError as exc:
            return _error(f"media: {exc}", status=400, kind=type(exc).__name__)
        except (ProtocolError, ValueError) as exc:
            logger.info("%s %s -> 400: %s", request.method, path, exc)
            return _error(str(exc), status=400, kind="BadRequestError")
        except Exception as exc:
            logger.exception("%s %s failed", request.method, path)
            return _error(f"{type(exc).__name__}: {exc}", status=500, kind="InternalServerError")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _BadRequest(f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise _BadRequest("the request body must be a JSON object")
        if body.get("stream"):
            raise _BadRequest("stream=true is not supported by this server")
        return body

    # ------------------------------------------------------------------ shared core

    def _sampling(self, body: Mapping[str, Any], prompt_len: int, max_tokens: int | None) -> SamplingConfig:
        room = self.config.max_model_len - prompt_len
        if room <= 0:
            raise ContextLengthError(prompt_tokens=prompt_len, max_model_len=self.config.max_model_len)
        stop = body.get("stop")
        if stop:
            raise _BadRequest("'stop' strings are not supported; use 'stop_token_ids'")
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
        ):
            raise _BadRequest("'stop_token_ids' must be a list of integers")
        seed = _int_or_none(body, "seed")
        try:
            return SamplingConfig(
                temperature=_number(body, "temperature", 1.0),
                top_p=_number(body, "top_p", 1.0),
                max_tokens=min(self.config.default_max_tokens if max_tokens is None else max_tokens, room),
                stop_token_ids=tuple(stop_ids),
                seed=seed,
            )
        except ValueError as exc:
            raise _BadRequest(str(exc)) from exc

    async def _prepare(
        self,
        build: Callable[[], list[ChatMessage]],
        tools: list[dict[str, Any]],
        kwargs: Mapping[str, Any] | None,
    ) -> GenerationInput:
        def work() -> GenerationInput:
            messages = build()
            # decode every image once: the placeholder expansion and the GenerationInput share it
            history = ConversationHistory()
            history.append((), [p for m in messages for p in m.media])
            decoded = {
                id(item): image for item, image in zip(history.media, history.decoded_media(), strict=True)
            }
            rendered = self.codec.render(
                messages, tools, chat_template_kwargs=kwargs, decode=lambda item: decoded[id(item)]
            )
            history.append(rendered.prompt_token_ids)
            return build_generation_input(history)

        # media fetches, decoding and the processor are blocking: keep them off the event loop
        return await asyncio.to_thread(work)

    async def _generate(self, inp: GenerationInput, sampling: SamplingConfig) -> Generation:
        return (await self.generator.generate([inp], sampling))[0]

    # ------------------------------------------------------------------ handlers

    async def _health(self, _request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def _models(self, _request: web.Request) -> web.Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model_name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "gymbridge",
                        "root": self.config.model_name,
                        "max_model_len": self.config.max_model_len,
                    }
                ],
            }
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if "messages" in body:
            inp = await self._prepare(
                lambda: chat_to_messages(body["messages"], policy=self.media_policy),
                _chat_tools(body),
                _template_kwargs(body),
            )
            prompt = inp.prompt_token_ids
        elif isinstance(body.get("prompt"), str):
            prompt = self.codec.encode(body["prompt"])
        else:
            raise _BadRequest("/tokenize needs 'messages' or a string 'prompt'")
        return _json({"count": len(prompt), "max_model_len": self.config.max_model_len, "tokens": prompt})

    async def _chat_completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body.get("n") not in (None, 1):
            raise _BadRequest("n must be 1: this server returns one choice with its token ids")
        inp = await self._prepare(
            lambda: chat_to_messages(body.get("messages"), policy=self.media_policy),
            _chat_tools(body),
            _template_kwargs(body),
        )
        prompt = inp.prompt_token_ids
        sampling = self._sampling(
            body, len(prompt), _int_or_none(body, "max_completion_tokens", "max_tokens")
        )
        gen = await self._generate(inp, sampling)
        parsed = self.codec.parse(gen.token_ids)
        as_ids = bool(body.get("return_tokens_as_token_ids", True))
        finish = "tool_calls" if parsed.tool_calls and gen.finish_reason == "stop" else gen.finish_reason
        choice: dict[str, Any] = {
            "index": 0,
            "message": chat_message(parsed, reasoning_field=self.config.reasoning_parser),
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": list(gen.token_ids),
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {
                        "token": f"token_id:{t}" if as_ids else self.codec.tokenizer.decode([t]),
                        "logprob": lp,
                        "bytes": None,
                        "top_logprobs": [],
                    }
                    for t, lp in zip(gen.token_ids, gen.logprobs, strict=True)
                ]
            }
        return _json(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": str(body.get("model") or self.config.model_name),
                "choices": [choice],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(gen.token_ids),
                    "total_tokens": len(prompt) + len(gen.token_ids),
                },
                "prompt_token_ids": list(prompt),
            }
        )

    async def _responses(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body.get("n") not in (None, 1):
            raise _BadRequest("n must be 1")
        tools = responses_tools_to_chat(body.get("tools"))
        metadata = body.get("metadata") if isinstance(body.get("metadata"), Mapping) else None
        inp = await self._prepare(
            lambda: responses_to_messages(
                body.get("input"),
                instructions=body.get("instructions"),
                metadata=metadata,
                policy=self.media_policy,
            ),
            tools,
            None,
        )
        prompt = inp.prompt_token_ids
        base = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "model": str(body.get("model") or self.config.model_name),
            "error": None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
        }
        try:
            sampling = self._sampling(body, len(prompt), _int_or_none(body, "max_output_tokens"))
        except ContextLengthError as exc:
            logger.info("responses: %s", exc)
            return _json(
                base
                | {
                    "status": "incomplete",
                    "incomplete_details": {"reason": "max_output_tokens"},
                    "output": [],
                    "usage": {"input_tokens": len(prompt), "output_tokens": 0, "total_tokens": len(prompt)},
                }
            )
        gen = await self._generate(inp, sampling)
        items = response_items(self.codec.parse(gen.token_ids), gen, prompt)
        incomplete = gen.finish_reason == "length"
        return _json(
            base
            | {
                "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": items,
                "usage": {
                    "input_tokens": len(prompt),
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": len(gen.token_ids),
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": len(prompt) + len(gen.token_ids),
                },
            }
        )
