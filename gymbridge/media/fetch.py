"""Guarded http(s) fetch of media bytes (sync and async, httpx).

Invariants — every one is checked on the first request **and on every redirect
hop** (redirects are followed by hand, never by httpx):

* only ``http`` / ``https`` URLs, no credentials in the URL;
* a host listed in ``MediaPolicy.allowed_http_hosts`` (``host`` or
  ``host:port``) is trusted as is; any other host is resolved (with the fetch
  deadline) and refused when **any** of its addresses is loopback, private,
  link-local, site-local, multicast, reserved, unspecified or otherwise not global. The
  request then goes to the checked address itself (``Host`` header and TLS SNI
  keep the name), so a second DNS answer cannot swap in a private address
  (DNS rebinding);
* a host in ``MediaPolicy.media_hosts`` (a gymbridge media store) is trusted as is,
  but only for a media reference (path ``/media/<content key>``, see
  :mod:`gymbridge.media.store`): any other path there is refused, a redirect from a
  media host to any other host is refused, and the body must hash to the key in the
  path (else :class:`~gymbridge.errors.MediaError`: wrong bytes never load);
* at most ``max_redirects`` hops;
* the body is read raw (``Accept-Encoding: identity``, no transparent
  decompression) and refused as soon as it exceeds ``max_encoded_bytes``
  (``Content-Length`` is checked before reading);
* the whole fetch — DNS, every hop, the body — has one deadline,
  ``fetch_timeout_s``; a slow-drip server cannot stretch it.

Failures map to :mod:`gymbridge.errors`: a refusal is ``MediaPolicyError``;
a timeout, a transport failure, 408, 429 and 5xx are ``MediaFetchError(retryable=True)``;
404 and other 4xx, and too many redirects, are ``MediaFetchError(retryable=False)``.
No httpx exception escapes this module.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

import httpx

from gymbridge.errors import MediaError, MediaFetchError, MediaPolicyError
from gymbridge.media.hashing import content_key
from gymbridge.media.policy import MediaPolicy
from gymbridge.media.refs import HttpRef, parse_http, shorten
from gymbridge.media.store import parse_media_ref

__all__ = ["afetch_http", "check_address", "check_url", "fetch_http", "verify_media"]

logger = logging.getLogger(__name__)

_AddrInfo = list[tuple[Any, ...]]
_dns_pool: ThreadPoolExecutor | None = None
_dns_pool_lock = threading.Lock()


def check_address(address: str) -> str | None:
    """Why ``address`` (an IP literal) may not be fetched from, or ``None`` when it is public."""
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is not None:
            ip = embedded
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_private:
        return "private"
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:  # fec0::/10: not in is_private
        return "site-local"
    if ip.is_reserved:
        return "reserved"
    if not ip.is_global:
        return "non-global"
    return None


@dataclass(frozen=True, slots=True)
class _Hop:
    ref: HttpRef
    allowed: bool
    literal: bool
    media_key: str | None = None
    """The content key the body must hash to (a media reference on a media host)."""


def check_url(url: str, policy: MediaPolicy, source: str) -> _Hop:
    """Static checks of one hop (scheme, credentials, literal addresses); no DNS, no I/O."""
    try:
        ref = parse_http(url)
    except MediaPolicyError as exc:
        if url == source:
            raise
        raise MediaPolicyError(
            f"URL {shorten(source)!r}: redirect hop refused: {exc}", source=shorten(source)
        ) from exc
    allowed = policy.host_allowed(ref.host, ref.port)
    media_key: str | None = None
    if policy.is_media_host(ref.host, ref.port):
        media_key = parse_media_ref(url)
        if media_key is None and not _listed_plainly(ref, policy):
            raise MediaPolicyError(
                f"URL {shorten(source)!r}: {ref.host}:{ref.port} is a media store, which serves only "
                "/media/<content key> references",
                source=shorten(source),
            )
    if url != source:
        source_key = _media_source_key(source, policy)
        if source_key is not None:  # a redirect from a media reference: same store, same key
            if media_key is None:
                raise MediaPolicyError(
                    f"URL {shorten(source)!r}: redirect off the media store to {shorten(url)!r} refused",
                    source=shorten(source),
                )
            media_key = source_key
    try:
        ipaddress.ip_address(ref.host.split("%", 1)[0])
        literal = True
    except ValueError:
        literal = False
    if literal and not allowed:
        _refuse_if_bad(ref, [ref.host], policy, source)
    return _Hop(ref=ref, allowed=allowed, literal=literal, media_key=media_key)


def _listed_plainly(ref: HttpRef, policy: MediaPolicy) -> bool:
    """Whether ``ref``'s host is also in ``allowed_http_hosts`` (then any path may be fetched)."""
    plain = policy.model_copy(update={"media_hosts": ()})
    return plain.host_allowed(ref.host, ref.port)


def _media_source_key(source: str, policy: MediaPolicy) -> str | None:
    """The key of ``source`` when it is a media reference on a media host, else ``None``."""
    try:
        ref = parse_http(source)
    except MediaPolicyError:
        return None
    return parse_media_ref(source) if policy.is_media_host(ref.host, ref.port) else None


def verify_media(body: bytes, hop: _Hop, source: str) -> bytes:
    """``body`` when it hashes to the key of a media reference (or there is no key), else ``MediaError``."""
    if hop.media_key is not None:
        actual = content_key(body)
        if actual != hop.media_key:
            raise MediaError(
                f"URL {shorten(source)!r}: the media store answered bytes with sha256 {actual}, "
                f"not the referenced key {hop.media_key}; refused",
                source=shorten(source),
            )
    return body


def _refuse_if_bad(ref: HttpRef, addresses: list[str], policy: MediaPolicy, source: str) -> None:
    for address in addresses:
        reason = check_address(address)
        if reason is not None:
            hop = "" if ref.url == source else f" (redirect hop {shorten(ref.url)!r})"
            raise MediaPolicyError(
                f"URL {shorten(source)!r}{hop}: host {ref.host!r} resolves to {reason} address {address}; "
                f"refused unless '{ref.host}' or '{ref.host}:{ref.port}' is in allowed_http_hosts "
                f"(now {list(policy.allowed_http_hosts)})",
                source=shorten(source),
            )


def _addresses(infos: _AddrInfo) -> list[str]:
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _dns_error(exc: OSError | UnicodeError, ref: HttpRef, source: str) -> MediaFetchError:
    retryable = isinstance(exc, socket.gaierror) and exc.errno == socket.EAI_AGAIN
    return MediaFetchError(
        f"URL {shorten(source)!r}: cannot resolve host {ref.host!r} ({exc})",
        source=shorten(source),
        retryable=retryable,
    )


def _request_args(hop: _Hop, address: str | None) -> tuple[httpx.URL, dict[str, str], dict[str, Any]]:
    url = httpx.URL(hop.ref.url)
    headers = {"Accept-Encoding": "identity"}
    extensions: dict[str, Any] = {}
    if address is not None and not hop.literal:
        # pin the checked address; keep the name for virtual hosting and TLS
        url = url.copy_with(host=address)
        default_port = 443 if hop.ref.scheme == "https" else 80
        name = f"[{hop.ref.host}]" if ":" in hop.ref.host else hop.ref.host
        headers["Host"] = name if hop.ref.port == default_port else f"{name}:{hop.ref.port}"
        if hop.ref.scheme == "https":
            extensions["sni_hostname"] = hop.ref.host
    return url, headers, extensions


def _timeout_error(source: str, policy: MediaPolicy) -> MediaFetchError:
    return MediaFetchError(
        f"URL {shorten(source)!r}: fetch took longer than fetch_timeout_s={policy.fetch_timeout_s}",
        source=shorten(source),
        retryable=True,
    )


def _status_error(status: int, url: str, source: str) -> MediaFetchError:
    retryable = status >= 500 or status in (408, 429)
    hop = "" if url == source else f" (at {shorten(url)!r})"
    return MediaFetchError(
        f"URL {shorten(source)!r}{hop}: HTTP {status}", source=shorten(source), retryable=retryable
    )


def _next_url(response: httpx.Response, current: str, source: str) -> str | None:
    """The redirect target, ``None`` for a 2xx body; raises for any other status."""
    status = response.status_code
    if 200 <= status < 300:
        return None
    if status in (301, 302, 303, 307, 308):
        location: str | None = response.headers.get("location")
        if not location:
            raise MediaFetchError(
                f"URL {shorten(source)!r}: HTTP {status} without a Location header",
                source=shorten(source),
                retryable=False,
            )
        return str(urljoin(current, location))
    raise _status_error(status, current, source)


def _check_length(response: httpx.Response, policy: MediaPolicy, source: str) -> None:
    length = response.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > policy.max_encoded_bytes:
        raise MediaPolicyError(
            f"URL {shorten(source)!r}: Content-Length {length} is over "
            f"max_encoded_bytes={policy.max_encoded_bytes}",
            source=shorten(source),
        )


def _append_capped(chunks: list[bytes], size: int, chunk: bytes, policy: MediaPolicy, source: str) -> int:
    size += len(chunk)
    if size > policy.max_encoded_bytes:
        raise MediaPolicyError(
            f"URL {shorten(source)!r}: body is over max_encoded_bytes={policy.max_encoded_bytes}",
            source=shorten(source),
        )
    chunks.append(chunk)
    return size


def _too_many_redirects(source: str, policy: MediaPolicy) -> MediaFetchError:
    return MediaFetchError(
        f"URL {shorten(source)!r}: more than max_redirects={policy.max_redirects} redirects",
        source=shorten(source),
        retryable=False,
    )


def _transport_error(exc: httpx.HTTPError, source: str) -> MediaFetchError:
    return MediaFetchError(
        f"URL {shorten(source)!r}: transport error {type(exc).__name__}: {exc}",
        source=shorten(source),
        retryable=True,
    )


def _dns_executor() -> ThreadPoolExecutor:
    global _dns_pool
    with _dns_pool_lock:
        if _dns_pool is None:
            _dns_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gymbridge-dns")
        return _dns_pool


def _resolve_sync(ref: HttpRef, deadline: float, policy: MediaPolicy, source: str) -> list[str]:
    """``getaddrinfo`` in a worker thread so the fetch deadline also bounds DNS."""
    future = _dns_executor().submit(socket.getaddrinfo, ref.host, ref.port, type=socket.SOCK_STREAM)
    try:
        infos: _AddrInfo = future.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeoutError as exc:
        raise _timeout_error(source, policy) from exc
    except (OSError, UnicodeError) as exc:
        raise _dns_error(exc, ref, source) from exc
    return _addresses(infos)


def _run_private_loop(coro: Coroutine[Any, Any, bytes]) -> bytes:
    """Run ``coro`` to completion on a private event loop (in a helper thread when this thread
    already runs a loop, e.g. ``item.raw`` touched inside a coroutine)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gymbridge-fetch") as pool:
        return pool.submit(asyncio.run, coro).result()


def fetch_http(url: str, policy: MediaPolicy, *, client: httpx.Client | None = None) -> bytes:
    """GET ``url`` under ``policy`` (see the module docstring); return the body bytes.

    Without ``client`` the fetch runs :func:`afetch_http` on a private event loop, so
    ``fetch_timeout_s`` bounds everything, even a server that drips its headers (a
    blocking socket read only has a per-read timeout). With a caller's ``client`` the
    deadline is checked between hops and body chunks, and each socket read is bounded
    by the time left.
    """
    if client is None:
        return _run_private_loop(afetch_http(url, policy))
    deadline = time.monotonic() + policy.fetch_timeout_s
    http = client
    try:
        current = url
        for _ in range(policy.max_redirects + 1):
            hop = check_url(current, policy, url)
            address: str | None = None
            if not hop.allowed and not hop.literal:
                addresses = _resolve_sync(hop.ref, deadline, policy, url)
                _refuse_if_bad(hop.ref, addresses, policy, url)
                address = addresses[0]
            target, headers, extensions = _request_args(hop, address)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _timeout_error(url, policy)
            logger.debug("fetching %s (hop %s, address %s)", shorten(url), shorten(current), address)
            with http.stream(
                "GET",
                target,
                headers=headers,
                extensions=extensions,
                timeout=httpx.Timeout(remaining),
                follow_redirects=False,
            ) as response:
                nxt = _next_url(response, current, url)
                if nxt is None:
                    _check_length(response, policy, url)
                    chunks: list[bytes] = []
                    size = 0
                    for chunk in response.iter_raw():
                        size = _append_capped(chunks, size, chunk, policy, url)
                        if time.monotonic() > deadline:
                            raise _timeout_error(url, policy)
                    return verify_media(b"".join(chunks), hop, url)
            current = nxt
        raise _too_many_redirects(url, policy)
    except httpx.TimeoutException as exc:
        raise _timeout_error(url, policy) from exc
    except httpx.HTTPError as exc:
        raise _transport_error(exc, url) from exc
    except httpx.InvalidURL as exc:  # not an HTTPError; urlsplit was more lenient than httpx
        raise MediaPolicyError(f"malformed URL {shorten(url)!r}: {exc}", source=shorten(url)) from exc


async def afetch_http(url: str, policy: MediaPolicy, *, client: httpx.AsyncClient | None = None) -> bytes:
    """Async :func:`fetch_http`: the same checks, one ``asyncio`` deadline over everything."""
    own = client is None
    http = client if client is not None else httpx.AsyncClient(trust_env=False, follow_redirects=False)
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(policy.fetch_timeout_s):
            current = url
            for _ in range(policy.max_redirects + 1):
                hop = check_url(current, policy, url)
                address: str | None = None
                if not hop.allowed and not hop.literal:
                    try:  # the shared pool: a hung resolver never blocks a loop's shutdown
                        infos = await loop.run_in_executor(
                            _dns_executor(),
                            functools.partial(
                                socket.getaddrinfo, hop.ref.host, hop.ref.port, type=socket.SOCK_STREAM
                            ),
                        )
                    except (OSError, UnicodeError) as exc:
                        raise _dns_error(exc, hop.ref, url) from exc
                    addresses = _addresses(infos)
                    _refuse_if_bad(hop.ref, addresses, policy, url)
                    address = addresses[0]
                target, headers, extensions = _request_args(hop, address)
                async with http.stream(
                    "GET",
                    target,
                    headers=headers,
                    extensions=extensions,
                    timeout=httpx.Timeout(policy.fetch_timeout_s),
                    follow_redirects=False,
                ) as response:
                    nxt = _next_url(response, current, url)
                    if nxt is None:
                        _check_length(response, policy, url)
                        chunks: list[bytes] = []
                        size = 0
                        async for chunk in response.aiter_raw():
                            size = _append_capped(chunks, size, chunk, policy, url)
                        return verify_media(b"".join(chunks), hop, url)
                current = nxt
            raise _too_many_redirects(url, policy)
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise _timeout_error(url, policy) from exc
    except httpx.HTTPError as exc:
        raise _transport_error(exc, url) from exc
    except httpx.InvalidURL as exc:  # not an HTTPError; urlsplit was more lenient than httpx
        raise MediaPolicyError(f"malformed URL {shorten(url)!r}: {exc}", source=shorten(url)) from exc
    finally:
        if own:
            await http.aclose()
