"""The model server: an aiohttp app over any ``Generator``, speaking NeMo Gym's model protocol.

Routes: ``POST /v1/responses`` (token fields on the call's last output item; ``length`` becomes
``status: "incomplete"``), ``POST /v1/chat/completions`` (vLLM's training shape, what genuine
``vllm_model`` sends), ``POST /tokenize``, ``GET /v1/models``, health routes, ``GET /media_cache``,
``GET /counters`` (:meth:`ModelServer.counters`), and with a ``weight_sink`` the ``/weights/*``
routes a trainer publishes through (:mod:`gymbridge.trainer.weight_sync`). Paths may arrive prefixed
``/ng-rollout/<id>``.

The ``/weights/*`` routes change the policy, so they answer only a caller that presents the run
secret (``Authorization: Bearer <secret>``, compared in constant time): anyone else gets a 401 and
nothing changes; a weight sink without a secret is refused at construction. The other routes stay
open (agents need them). A child server reads its secret from ``GYMBRIDGE_WEIGHTS_SECRET``
(:data:`WEIGHTS_SECRET_ENV`), never from its command line (docs/security.md, "Weight routes: the
run secret").

Invariants:

* prompts are built by :meth:`ChatCodec.render` only (exact prefix splice of the latest replayed
  assistant tokens); media go through ``load_media`` under the server's ``MediaPolicy``, and each
  medium is fetched, decoded and processed once per content key (:class:`~gymbridge.media.cache.MediaCache`);
* ``n`` must be 1; concurrent requests are batched into the generator (:class:`BatchingGenerator`,
  unless the backend batches itself), and a seeded request is never batched with another call;
* each generation is parsed in the codec's tool-call format (:mod:`gymbridge.generation.tool_calls`)
  with the request's tools; its calls are counted (``tool_calls_parsed``, ``tool_calls_unparsed``) and
  markup that does not parse stays a plain message whose item says why (``tool_call_errors``);
* bad input is a 4xx JSON error body ``{"object": "error", "message", "type", "param", "code"}``,
  logged, never a crash or a 5xx (docs/security.md); unexpected failures are a 500 of the same shape;
* request preparation runs in the server's own bounded thread pools, off the event loop; media
  requests decode in a separate pool, so text-only requests never wait behind image decoding.

Routes, limits and the media cache in detail: docs/generation.md, "The model server"; the weight
routes: docs/placement.md; counters: docs/timing.md.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import logging
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gymbridge.errors import MediaError, MediaFetchError, ProtocolError, WeightSyncError
from gymbridge.generation.batching import BatchingGenerator, needs_batching
from gymbridge.generation.chat import (
    ChatCodec,
    ChatMessage,
    ParsedOutput,
    chat_to_messages,
    responses_to_messages,
    responses_tools_to_chat,
)
from gymbridge.generation.outputs import chat_message, response_items
from gymbridge.generation.tool_calls import mark_unparsed
from gymbridge.generation.types import ContextLengthError, Generation, Generator, SamplingConfig
from gymbridge.limits import loads_json
from gymbridge.media.cache import DEFAULT_MEDIA_CACHE_BYTES, MediaCache
from gymbridge.serving import bind_error, check_port
from gymbridge.trajectory.refresh import ConversationHistory, build_generation_input
from gymbridge.trajectory.types import GenerationInput

if TYPE_CHECKING:
    from gymbridge.generation.weights import WeightSink
    from gymbridge.media import MediaItem, MediaPolicy

logger = logging.getLogger(__name__)

__all__ = [
    "MIN_WEIGHTS_SECRET_CHARS",
    "WEIGHTS_SECRET_ENV",
    "ModelServer",
    "ModelServerConfig",
    "check_weights_secret",
]

_ROLLOUT_PREFIX = re.compile(r"^/ng-rollout/[^/]+")
_GUARDED_PREFIX = "/weights/"
"""Routes under it change (or report) the served weights: each call must carry the run secret."""

WEIGHTS_SECRET_ENV = "GYMBRIDGE_WEIGHTS_SECRET"
"""The environment variable that hands ``gymbridge model serve`` its run secret (argv would show it
in ``ps``)."""
MIN_WEIGHTS_SECRET_CHARS = 16
"""Shortest accepted run secret (``secrets.token_urlsafe(32)``, what a launcher makes, has 43)."""
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


def check_weights_secret(secret: str) -> None:
    """Refuse a run secret too short to guess-proof the weight routes (``ValueError``; the message
    never contains the secret)."""
    if len(secret) < MIN_WEIGHTS_SECRET_CHARS:
        raise ValueError(
            f"the run secret must have at least {MIN_WEIGHTS_SECRET_CHARS} characters, got {len(secret)} "
            "(make one with python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )


def _bearer_token(header: str | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive), else ``None``."""
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token.encode("utf-8", "surrogatepass")  # aiohttp decodes undecodable bytes as surrogates


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
    max_body_bytes: int = 256 * 1024 * 1024
    """Larger request bodies answer 413 (verify-sized payloads carry images as data URLs)."""
    prepare_threads: int = 4
    """Threads that build and tokenize requests (the server's own pool, not the default executor)."""
    media_threads: int = 2
    """Threads that decode media and render requests carrying media: at most this many
    requests hold images being decoded at once (docs/security.md gives the memory budget)."""
    media_cache_bytes: int = DEFAULT_MEDIA_CACHE_BYTES
    """Bound of the media cache (fetched, decoded and processed media by content key); 0: off."""


MAX_TEMPERATURE = 100.0
"""Largest accepted temperature: beyond it the scaled logits are numerically meaningless."""


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    """``body[key]`` as a finite float in ``[lo, hi]`` (400 otherwise; huge ints included)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _BadRequest(f"'{key}' must be a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and lo <= number <= hi):
        raise _BadRequest(f"'{key}' must be a finite number in [{lo:g}, {hi:g}], got {value!r}")
    return number


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
    ``MediaPolicy()``) governs every media part of every request; ``weight_sink`` (default
    none: the ``/weights/*`` routes answer 403) receives the trainer's weights from callers that
    present ``weights_secret`` (the run secret; required with a ``weight_sink``, at least
    :data:`MIN_WEIGHTS_SECRET_CHARS` characters).
    """

    def __init__(
        self,
        generator: Generator,
        *,
        codec: ChatCodec | None = None,
        config: ModelServerConfig | None = None,
        media_policy: MediaPolicy | None = None,
        weight_sink: WeightSink | None = None,
        weights_secret: str | None = None,
    ) -> None:
        if weights_secret is not None:
            check_weights_secret(weights_secret)
        elif weight_sink is not None:
            raise ValueError(
                "a weight_sink needs weights_secret= (the run secret its trainer's publisher sends): "
                "without one nobody could be told apart from the trainer"
            )
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
        from gymbridge.metrics.timing import PhaseTimer

        self.timings = PhaseTimer()
        """The server's own counters (module docstring, "Counters"); :meth:`counters` reads them."""
        self._batched = self.config.batching and needs_batching(generator)
        self.generator: Generator = (
            BatchingGenerator(
                generator,
                max_batch_size=self.config.max_batch_size,
                window_s=self.config.batch_window_s,
                timer=self.timings,
            )
            if self._batched
            else generator
        )
        if media_policy is None:
            from gymbridge.media import MediaPolicy

            media_policy = MediaPolicy()
        self.media_policy = media_policy
        self.media_cache = MediaCache(self.config.media_cache_bytes)
        from gymbridge.tensors.processor import sub_processors

        self._subs = (
            sub_processors(self.codec.processor) if self.codec.processor is not self.codec.tokenizer else {}
        )
        self._cache_users: list[Callable[[MediaCache | None], None]] = []
        inner: Any = generator
        for _ in range(8):  # through wrappers: the HF backend reuses the cached processor outputs
            use = getattr(inner, "use_media_cache", None)
            if callable(use):
                use(self.media_cache)
                self._cache_users.append(use)
            inner = getattr(inner, "inner", None) or getattr(inner, "generator", None)
            if inner is None:
                break
        if self.config.prepare_threads < 1 or self.config.media_threads < 1:
            raise ValueError("prepare_threads and media_threads must be >= 1")
        self._prepare_pool = ThreadPoolExecutor(self.config.prepare_threads, thread_name_prefix="gb-prepare")
        self._media_pool = ThreadPoolExecutor(self.config.media_threads, thread_name_prefix="gb-media")
        self._max_token_chars = _longest_token_chars(self.codec)
        self._runner: web.AppRunner | None = None
        self.url: str | None = None
        self.weight_sink = weight_sink
        self._weights_secret = weights_secret.encode() if weights_secret is not None else None
        self._weight_task: asyncio.Task[None] | None = None
        self._weight_error: str | None = None
        self._weight_syncs = 0
        self._last_sync_s = 0.0
        self._group_ready = False
        self._warned_unparsed = False
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
            ("POST", "/weights/init_group"): self._weights_init_group,
            ("POST", "/weights/update"): self._weights_update,
            ("GET", "/weights/status"): self._weights_status,
            ("GET", "/media_cache"): self._media_cache_stats,
            ("GET", "/counters"): self._counters,
        }

    # ------------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_cleanup(self, _app: web.Application) -> None:
        if self._weight_task is not None and not self._weight_task.done():
            self._weight_task.cancel()
        if self.weight_sink is not None:
            self.weight_sink.close()
        if isinstance(self.generator, BatchingGenerator):
            await self.generator.aclose()
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        self._media_pool.shutdown(wait=False, cancel_futures=True)
        for use in self._cache_users:  # a generator outliving this server keeps no cache of ours
            use(None)
        stats = self.media_cache.stats()
        if stats["kinds"]:
            logger.info("model server media cache: %s", orjson.dumps(stats).decode())

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0 = a free port); return the base URL (without ``/v1``)."""
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
        logger.info(
            "model server %s listening on %s (tool calls: %s)",
            self.config.model_name,
            self.url,
            self.codec.tool_parser or "not parsed",
        )
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
        if path.startswith(_GUARDED_PREFIX):
            refused = self._refuse_unauthenticated(request, path)
            if refused is not None:
                return refused
        try:
            return await handler(request)
        except _BadRequest as exc:
            logger.info("%s %s -> %d: %s", request.method, path, exc.status, exc)
            return _error(str(exc), status=exc.status, kind=exc.kind)
        except ContextLengthError as exc:
            return _error(str(exc), status=400, kind="BadRequestError")
        except WeightSyncError as exc:
            logger.warning("%s %s -> 400: %s", request.method, path, exc)
            return _error(str(exc), status=400, kind="WeightSyncError")
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
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise _BadRequest(
                f"the request body is over the server's limit of {self.config.max_body_bytes} bytes",
                status=413,
                kind="RequestEntityTooLarge",
            ) from exc
        try:
            body = loads_json(raw, "the request body")
        except ProtocolError as exc:
            raise _BadRequest(str(exc)) from exc
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
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in stop_ids
        ):
            raise _BadRequest("'stop_token_ids' must be a list of integers in [0, 2**31)")
        seed = _int_or_none(body, "seed")
        if seed is not None and not -(2**63) <= seed < 2**64:
            raise _BadRequest(f"'seed' must fit in 64 bits, got {seed}")
        try:
            return SamplingConfig(  # a temperature below GREEDY_BELOW_TEMPERATURE becomes greedy here
                temperature=_number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
                top_p=_number(body, "top_p", 1.0, 5e-324, 1.0),
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
        def build_checked() -> list[ChatMessage]:
            messages = build()
            self._refuse_overlong_text(messages)
            return messages

        def work(messages: list[ChatMessage]) -> GenerationInput:
            # each medium decoded and processed once per content key (the cache), shared by the
            # placeholder expansion, the GenerationInput and the HF forward
            history = ConversationHistory(decoder=self._decoded)
            history.append((), [p for m in messages for p in m.media])
            rendered = self.codec.render(
                messages,
                tools,
                chat_template_kwargs=kwargs,
                decode=self._decoded,
                placeholders=self._placeholders,
            )
            history.append(rendered.prompt_token_ids)
            return build_generation_input(history)

        # media fetches, decoding and the processor are blocking: keep them off the event loop, in
        # the server's own bounded pools (a flood of huge requests cannot take the default executor)
        loop = asyncio.get_running_loop()
        with self.timings.time("prepare"):
            messages = await loop.run_in_executor(self._prepare_pool, build_checked)
            pool = self._media_pool if any(m.media for m in messages) else self._prepare_pool
            return await loop.run_in_executor(pool, work, messages)

    # ------------------------------------------------------------------ media by content key

    def _load_media(self, source: str, modality: Any) -> MediaItem:
        """A conversation's medium: a media-store reference fetched once per key, else loaded."""
        from gymbridge.media import load_media
        from gymbridge.media.refs import parse_http
        from gymbridge.media.store import parse_media_ref

        key = parse_media_ref(source)
        if key is not None:
            ref = parse_http(source)
            if self.media_policy.is_media_host(ref.host, ref.port):

                def fetch() -> MediaItem:
                    item = load_media(source, modality, self.media_policy)
                    if item.key != key:  # the fetch verifies too; a cache entry must never lie
                        raise MediaError(f"{source}: bytes hash to {item.key}, not the key in the URL")
                    return item

                cached = self.media_cache.get_or_make(f"fetched:{modality}", key, fetch)
                return cached
        return load_media(source, modality, self.media_policy)

    def _decoded(self, item: MediaItem) -> Any:
        """``item`` decoded (PIL image, frames, waveform), once per content key."""
        modality = item.modality
        decode = item.image if modality == "image" else item.video if modality == "video" else item.audio
        return self.media_cache.get_or_make(f"decoded:{modality}", item.key, decode)

    def _placeholders(self, item: MediaItem) -> int | None:
        """Placeholder tokens of ``item`` (its family's count) from its outputs, processed once per key."""
        from gymbridge.tensors.processor import process_cached

        sub = self._subs.get(item.modality)
        if sub is None:
            return None
        try:
            outputs = process_cached(
                self.media_cache, item.modality, sub, item.key, lambda: self._decoded(item)
            )
        except MediaError:
            raise
        except Exception as exc:
            raise ProtocolError(
                f"{type(sub).__name__} failed on a {item.modality}: {type(exc).__name__}: {exc}"
            ) from exc
        return self.codec.family.num_placeholders(item.modality, outputs, self.codec.processor)

    async def _media_cache_stats(self, _request: web.Request) -> web.Response:
        return _json(self.media_cache.stats())

    def _refuse_overlong_text(self, messages: list[ChatMessage]) -> None:
        """Refuse (``ContextLengthError``) a prompt whose text alone cannot fit, before tokenizing it.

        No token covers more than ``_max_token_chars`` characters, so ``chars // _max_token_chars``
        is a lower bound of the prompt's tokens: a 10 MB prompt is refused in microseconds
        instead of seconds of tokenization and gigabytes of token lists.
        """
        chars = 0
        for m in messages:
            chars += len(m.text) + sum(len(r) for r in m.reasoning)
            chars += sum(len(c.name) + len(c.arguments) for c in m.tool_calls)
        at_least = chars // self._max_token_chars
        if at_least > self.config.max_model_len:
            raise ContextLengthError(prompt_tokens=at_least, max_model_len=self.config.max_model_len)

    async def _generate(self, inp: GenerationInput, sampling: SamplingConfig) -> Generation:
        timer = self.timings
        with timer.time("generate"):
            if self._batched:  # the batching layer times each batched call as ``compute``
                gen = (await self.generator.generate([inp], sampling))[0]
            else:  # a backend batching on its own (vLLM): its time is the requests' time
                with timer.time("compute"):
                    gen = (await self.generator.generate([inp], sampling))[0]
        timer.count("prompt_tokens", len(inp.prompt_token_ids))
        timer.count("generated_tokens", len(gen.token_ids))
        return gen

    def _parse(self, gen: Generation, tools: list[dict[str, Any]]) -> ParsedOutput:
        """The generation parsed; its tool calls counted (``tool_calls_parsed``, ``tool_calls_unparsed``)."""
        parsed = self.codec.parse(gen.token_ids, tools)
        self.timings.count("tool_calls_parsed", len(parsed.tool_calls))
        self.timings.count("tool_calls_unparsed", len(parsed.unparsed_tool_calls))
        if parsed.unparsed_tool_calls and not self._warned_unparsed:
            self._warned_unparsed = True
            first = parsed.unparsed_tool_calls[0]
            logger.warning(
                "a generation holds a tool call that does not parse as %s (%s): it stays a plain message "
                "(tool_call_unparsed, counted in /counters as tool_calls_unparsed; logged once): %r",
                first.format,
                first.reason,
                first.as_json()["markup"],
            )
        return parsed

    def counters(self) -> dict[str, float]:
        """The server's counters now (module docstring, "Counters"): every value only grows."""
        return self.timings.snapshot()

    async def _counters(self, _request: web.Request) -> web.Response:
        return _json(self.counters())

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
                lambda: chat_to_messages(body["messages"], loader=self._load_media),
                _chat_tools(body),
                _template_kwargs(body),
            )
            prompt = inp.prompt_token_ids
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
            if len(text) // self._max_token_chars > self.config.max_model_len:
                raise ContextLengthError(
                    prompt_tokens=len(text) // self._max_token_chars, max_model_len=self.config.max_model_len
                )
            loop = asyncio.get_running_loop()
            prompt = await loop.run_in_executor(self._prepare_pool, self.codec.encode, text)
        else:
            raise _BadRequest("/tokenize needs 'messages' or a string 'prompt'")
        return _json({"count": len(prompt), "max_model_len": self.config.max_model_len, "tokens": prompt})

    async def _chat_completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body.get("n") not in (None, 1):
            raise _BadRequest("n must be 1: this server returns one choice with its token ids")
        self._sampling(body, 0, _int_or_none(body, "max_completion_tokens", "max_tokens"))  # 400s first
        tools = _chat_tools(body)
        inp = await self._prepare(
            lambda: chat_to_messages(body.get("messages"), loader=self._load_media),
            tools,
            _template_kwargs(body),
        )
        prompt = inp.prompt_token_ids
        sampling = self._sampling(
            body, len(prompt), _int_or_none(body, "max_completion_tokens", "max_tokens")
        )
        gen = await self._generate(inp, sampling)
        parsed = self._parse(gen, tools)
        as_ids = bool(body.get("return_tokens_as_token_ids", True))
        finish = "tool_calls" if parsed.tool_calls and gen.finish_reason == "stop" else gen.finish_reason
        message = chat_message(parsed, reasoning_field=self.config.reasoning_parser)
        if parsed.unparsed_tool_calls:
            message["tool_call_errors"] = [u.as_json() for u in parsed.unparsed_tool_calls]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
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
        extra = {} if gen.policy_version is None else {"policy_version": gen.policy_version}
        return _json(
            extra
            | {
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
        build = lambda: responses_to_messages(  # noqa: E731 - built in the preparation pool
            body.get("input"),
            instructions=body.get("instructions"),
            metadata=metadata,
            loader=self._load_media,
        )
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
        self._sampling(body, 0, _int_or_none(body, "max_output_tokens"))  # a bad field is 400 first
        try:
            inp = await self._prepare(build, tools, None)
            prompt = inp.prompt_token_ids
            sampling = self._sampling(body, len(prompt), _int_or_none(body, "max_output_tokens"))
        except ContextLengthError as exc:
            logger.info("responses: %s", exc)
            n = exc.prompt_tokens
            return _json(
                base
                | {
                    "status": "incomplete",
                    "incomplete_details": {"reason": "max_output_tokens"},
                    "output": [],
                    "usage": {"input_tokens": n, "output_tokens": 0, "total_tokens": n},
                }
            )
        gen = await self._generate(inp, sampling)
        parsed = self._parse(gen, tools)
        items = response_items(parsed, gen, prompt)
        mark_unparsed(items, parsed.unparsed_tool_calls)
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

    # ------------------------------------------------------------------ weight updates

    def _refuse_unauthenticated(self, request: web.Request, path: str) -> web.Response | None:
        """A 401 unless ``request`` carries the run secret; ``None`` lets it through (without a weight
        sink the handler answers 403 whoever asks). Neither the answer nor the log shows the token."""
        if self.weight_sink is None:
            return None
        presented = _bearer_token(request.headers.get("Authorization"))
        if (
            presented is not None
            and self._weights_secret is not None
            and hmac.compare_digest(presented, self._weights_secret)
        ):
            return None
        why = "no run secret" if presented is None else "a wrong run secret"
        logger.warning("%s %s from %s -> 401: %s", request.method, path, request.remote, why)
        response = _error(
            f"{why}: the weight routes need 'Authorization: Bearer <the run secret>' "
            f"(the trainer's publisher sends it; the server reads it from {WEIGHTS_SECRET_ENV})",
            status=401,
            kind="AuthenticationError",
        )
        response.headers["WWW-Authenticate"] = 'Bearer realm="gymbridge-weights"'
        return response

    def _sink(self) -> WeightSink:
        if self.weight_sink is None:
            raise _BadRequest(
                "weight updates are disabled on this server: start it with --enable-weight-updates",
                status=403,
                kind="PermissionDenied",
            )
        return self.weight_sink

    def _weights_busy(self) -> bool:
        return self._weight_task is not None and not self._weight_task.done()

    async def _run_weight_task(self, what: str, work: Awaitable[None]) -> None:
        try:
            await work
        except Exception as exc:  # recorded for /weights/status; the trainer times out or sees the mark
            self._weight_error = f"{what}: {type(exc).__name__}: {exc}"
            logger.error("weights %s failed: %s", what, exc)

    async def _weights_init_group(self, request: web.Request) -> web.Response:
        from gymbridge.generation.weights import TensorSpec

        sink = self._sink()
        if self._weights_busy():
            raise _BadRequest("a weight operation is in progress", status=409, kind="Conflict")
        body = await self._body(request)
        if body.get("transport") == "vllm":
            return await self._weights_vllm(sink, body)
        if body.get("transport", "broadcast") == "shared_memory":
            return await self._weights_attach_shared(sink, body)
        if body.get("transport", "broadcast") != "broadcast":
            raise _BadRequest("'transport' must be 'broadcast' or 'shared_memory'")
        host, port = body.get("host"), body.get("port")
        if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
            raise _BadRequest("'host' (string) and 'port' (int) are required")
        rank_offset = _int_or_none(body, "rank_offset") or 1
        world_size = _int_or_none(body, "world_size")
        if world_size is None or world_size < rank_offset + sink.ranks:
            raise _BadRequest(f"'world_size' must be >= rank_offset + {sink.ranks} (this server's ranks)")
        backend = body.get("backend", "gloo")
        if backend not in ("gloo", "nccl"):
            raise _BadRequest("'backend' must be 'gloo' or 'nccl'")
        timeout_s = _number(body, "timeout_s", 120.0, 1e-3, 86_400.0)
        tensors = body.get("tensors")
        if not isinstance(tensors, list):
            raise _BadRequest("'tensors' (the trainer's weight layout) must be a list")
        await self._prepare_lora(sink, body)
        sink.check([TensorSpec.from_json(t) for t in tensors])
        self._weight_error = None
        self._group_ready = False

        async def join() -> None:
            await sink.join(
                host=host,
                port=port,
                rank_offset=rank_offset,
                world_size=world_size,
                backend=backend,
                timeout_s=timeout_s,
            )
            self._group_ready = True

        self._weight_task = asyncio.create_task(self._run_weight_task("init_group", join()))
        return web.json_response({"status": "joining", "ranks": sink.ranks}, status=202)

    async def _prepare_lora(self, sink: WeightSink, body: dict[str, Any]) -> None:
        """``init_group``'s ``lora`` (the trainer's adapter settings, or absent): the sink takes them
        before the layout is checked (an HF model gets the same adapters injected)."""
        lora = body.get("lora")
        if lora is not None and not (isinstance(lora, dict) and isinstance(lora.get("r"), int)):
            raise _BadRequest("'lora' must be the trainer's adapter settings (an object with an int 'r')")
        prepare = getattr(sink, "prepare_lora", None)
        if not callable(prepare):
            if lora is not None:
                raise _BadRequest(
                    f"this generator ({type(sink).__name__}) cannot serve LoRA adapters",
                    kind="WeightSyncError",
                )
            return
        try:
            await asyncio.to_thread(prepare, lora)
        except (ValueError, TypeError, KeyError) as exc:
            raise _BadRequest(f"'lora': {exc}", kind="WeightSyncError") from exc

    async def _weights_attach_shared(self, sink: WeightSink, body: dict[str, Any]) -> web.Response:
        """``init_group`` with ``transport: shared_memory``: map the trainer's two segments now."""
        from gymbridge.generation.weights import TensorSpec

        attach = getattr(sink, "attach_shared", None)
        if not callable(attach):
            raise _BadRequest(
                f"this generator ({type(sink).__name__}) cannot load weights from shared memory",
                kind="WeightSyncError",
            )
        segments, nonce, tensors = body.get("segments"), body.get("nonce"), body.get("tensors")
        if not isinstance(segments, list) or not isinstance(nonce, str) or not isinstance(tensors, list):
            raise _BadRequest(
                "shared_memory needs 'segments' (list), 'nonce' (hex string) and 'tensors' (list)"
            )
        try:
            nonce_bytes = bytes.fromhex(nonce)
        except ValueError as exc:
            raise _BadRequest("'nonce' must be hex") from exc
        specs = [TensorSpec.from_json(t) for t in tensors]
        await self._prepare_lora(sink, body)
        sink.check(specs)
        self._weight_error = None
        self._group_ready = False
        await asyncio.to_thread(attach, segments, nonce_bytes, specs)
        self._group_ready = True
        return _json({"status": "attached", "transport": "shared_memory", "ranks": sink.ranks})

    async def _weights_update(self, request: web.Request) -> web.Response:
        from gymbridge.generation.weights import Bucket

        sink = self._sink()
        body = await self._body(request)
        timeout_s = _number(body, "timeout_s", 120.0, 1e-3, 86_400.0)
        if self._weight_task is not None and not self._weight_task.done():
            # the trainer's side of a join returns as soon as both ranks are in: ours may still be
            # finishing; a receive still running is the previous version, which must end first
            await asyncio.wait({self._weight_task}, timeout=timeout_s)
        if self._weights_busy():
            raise _BadRequest("a weight operation is in progress", status=409, kind="Conflict")
        if body.get("transport") == "vllm":
            return await self._weights_vllm(sink, body)
        if body.get("transport") == "shared_memory":
            return await self._weights_swap_shared(sink, body)
        if not self._group_ready:
            raise _BadRequest("no weight group: POST /weights/init_group first", status=409, kind="Conflict")
        version = _int_or_none(body, "version")
        if version is None or version < sink.policy_version:
            raise _BadRequest(f"'version' must be an int >= the loaded version {sink.policy_version}")
        raw = body.get("buckets")
        if not isinstance(raw, list):
            raise _BadRequest("'buckets' must be a list")
        buckets = [Bucket.from_json(b) for b in raw]
        sink.check([s for b in buckets for s in b.specs])

        async def receive() -> None:
            try:
                seconds = await sink.receive(version, buckets, timeout_s=timeout_s)
            except Exception as exc:
                sink.mark_loaded(version, f"error: {type(exc).__name__}: {exc}")
                raise
            self._weight_syncs += 1
            self._last_sync_s = seconds
            self.timings.add("weights_receive", seconds)
            sink.mark_loaded(version, "ok")

        self._weight_task = asyncio.create_task(
            self._run_weight_task(f"update to version {version}", receive())
        )
        return web.json_response({"status": "receiving", "version": version}, status=202)

    async def _weights_swap_shared(self, sink: WeightSink, body: dict[str, Any]) -> web.Response:
        """``update`` with ``transport: shared_memory``: the written segment becomes the weights."""
        swap = getattr(sink, "swap_shared", None)
        if not callable(swap) or getattr(sink, "transport", None) != "shared_memory":
            raise _BadRequest(
                "no shared-memory segments: POST /weights/init_group with them first",
                status=409,
                kind="Conflict",
            )
        version = _int_or_none(body, "version")
        if version is None or version < sink.policy_version:
            raise _BadRequest(f"'version' must be an int >= the loaded version {sink.policy_version}")
        segment = _int_or_none(body, "segment")
        if segment not in (0, 1):
            raise _BadRequest("'segment' must be 0 or 1")
        seconds = float(await asyncio.to_thread(swap, version, segment))
        self._weight_syncs += 1
        self._last_sync_s = seconds
        self.timings.add("weights_receive", seconds)
        # staged: live once the running generate call (if any) ends; /weights/status says when
        return _json({"status": "staged", "version": version, "transport": "shared_memory"})

    async def _weights_vllm(self, sink: WeightSink, body: dict[str, Any]) -> web.Response:
        """``transport: vllm``: one step of vLLM's own weight transfer (the sink's ``vllm_transfer``:
        :mod:`gymbridge.trainer.vllm_transfer` is the trainer's side)."""
        handle = getattr(sink, "vllm_transfer", None)
        if not callable(handle):
            raise WeightSyncError(
                f"this generator ({type(sink).__name__}) does not speak vLLM's weight transfer"
            )
        answer: dict[str, Any] = await handle(body)
        if answer.get("status") == "loaded":
            self._weight_syncs += 1
            self._last_sync_s = float(answer["seconds"])
            self.timings.add("weights_receive", self._last_sync_s)
        self._group_ready = self._group_ready or answer.get("status") == "ready"
        return _json(answer)

    async def _weights_status(self, _request: web.Request) -> web.Response:
        sink = self._sink()
        return _json(
            {
                "policy_version": sink.policy_version,
                "pending_version": getattr(sink, "pending_version", None),
                "vllm_transfer": bool(getattr(sink, "speaks_vllm_transfer", False)),
                "ranks": sink.ranks,
                "transport": getattr(sink, "transport", "broadcast"),
                "group_ready": self._group_ready,
                "busy": self._weights_busy(),
                "syncs": self._weight_syncs,
                "last_sync_s": self._last_sync_s,
                "error": self._weight_error,
            }
        )


def _longest_token_chars(codec: ChatCodec) -> int:
    """Characters of the longest token in the vocabulary (added tokens included; at least 1).

    A byte-level BPE vocabulary spells each byte as one character, so this also bounds the
    bytes a token covers; unknown tokenizers fall back to a generous 256.
    """
    try:
        vocab = codec.tokenizer.get_vocab()
        return max(1, max((len(t) for t in vocab), default=1))
    except Exception:  # a tokenizer without get_vocab: a bound that is still safe for real vocabularies
        return 256
