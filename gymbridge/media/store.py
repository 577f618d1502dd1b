"""A content-addressed media store and the small HTTP server in front of it.

Media by reference: instead of a base64 data URL, a request carries an ordinary
``http(s)`` image URL ``<base_url>/media/<key>`` whose last path segment is the item's
content key (:func:`gymbridge.media.hashing.content_key`, the hex sha256 of the encoded
bytes). Any client that fetches image URLs (a genuine NeMo Gym agent or model server)
can load it; gymbridge's own fetch verifies the bytes against the key
(:mod:`gymbridge.media.fetch`, ``MediaPolicy.media_hosts``).

:class:`MediaStore` invariants:

* ``put(data)`` returns ``content_key(data)`` and leaves the bytes at
  ``root/<key[:2]>/<key>``; the write goes through a temporary file in the same
  directory and ``os.replace``, so a reader never sees a partial file under a key;
  putting the same bytes again writes nothing (idempotent);
* a stored file is never changed (content addressing: one key, one content);
* ``get(key)`` verifies the sha256 of what it read: a file that does not hash to its
  key (disk corruption, a hand edit) is a :class:`~gymbridge.errors.MediaError`,
  never wrong bytes; an unknown key is a ``MediaFetchError(retryable=False)``;
* ``max_bytes`` (default none) caps one item's size; a bigger ``put`` is a
  :class:`~gymbridge.errors.MediaPolicyError`. Nothing is ever evicted: a reference
  handed out stays valid for the life of the store.

:class:`MediaServer` invariants:

* answers only ``GET`` and ``HEAD`` of ``/media/<64 lower-case hex>`` (plus ``GET
  /health``) and ``PUT /media/<key>`` (an upload, e.g. an agent storing a tool's image:
  stored only when the body hashes to ``key``, else 400; 201 new, 200 already stored,
  the key as the body; over ``max_bytes`` or 256 MiB 413); anything else is 404
  (unknown path or key) or 405 (another method);
* a peer whose address is neither loopback nor in ``allowed_peers`` gets 403 before
  the path is even looked at;
* the body is exactly the stored bytes (verified by ``MediaStore.get``; a corrupt
  file answers 500), with ``Content-Type`` sniffed from the magic bytes, an
  ``ETag`` of the key and ``Cache-Control: public, max-age=31536000, immutable``
  (``If-None-Match`` with the key answers 304);
* it never redirects; binds ``127.0.0.1`` by default; runs in a daemon thread, so
  ``start()`` / ``stop()`` work from sync code and from inside an event loop alike.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import secrets
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

from gymbridge.errors import MediaError, MediaFetchError, MediaPolicyError
from gymbridge.media.hashing import content_key
from gymbridge.media.refs import sniff_mime
from gymbridge.serving import bind_error, check_port

__all__ = ["MEDIA_PATH_PREFIX", "MediaServer", "MediaStore", "is_content_key", "parse_media_ref"]

logger = logging.getLogger(__name__)

MEDIA_PATH_PREFIX = "/media/"
"""Every reference's path is ``MEDIA_PATH_PREFIX + key``."""

_KEY = re.compile(r"[0-9a-f]{64}")
_REF_PATH = re.compile(r"(?:^|/)media/([0-9a-f]{64})$")
_IMMUTABLE = "public, max-age=31536000, immutable"
_MAX_UPLOAD_BYTES = 256 * 1024 * 1024
"""One upload's limit when the store sets no ``max_bytes``."""


def is_content_key(key: object) -> bool:
    """Whether ``key`` is a content key: 64 lower-case hex characters."""
    return isinstance(key, str) and _KEY.fullmatch(key) is not None


def parse_media_ref(url: str) -> str | None:
    """The content key of a media reference (an http(s) URL whose path ends in ``/media/<key>``),
    else ``None`` (a data URL, a file, any other URL). Pure: no I/O."""
    if not isinstance(url, str) or url[:4].lower() != "http":
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        return None
    match = _REF_PATH.search(parts.path)
    return match.group(1) if match is not None else None


class MediaStore:
    """Encoded media bytes on disk, named by their content key; see the module docstring."""

    def __init__(self, root: Path, *, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def path_for(self, key: str) -> Path:
        """Where ``key``'s bytes live (``ValueError`` for a malformed key)."""
        if not is_content_key(key):
            raise ValueError(f"not a content key (64 lower-case hex characters): {str(key)[:80]!r}")
        return self.root / key[:2] / key

    def put(self, data: bytes | bytearray | memoryview) -> str:
        """Store ``data`` (once) and return its content key."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        raw = bytes(data)
        if not raw:
            raise MediaPolicyError("refusing to store an empty media item", source="<media store>")
        if self.max_bytes is not None and len(raw) > self.max_bytes:
            raise MediaPolicyError(
                f"media item of {len(raw)} bytes is over the store's max_bytes={self.max_bytes}",
                source="<media store>",
            )
        key = content_key(raw)
        path = self.path_for(key)
        try:
            if path.stat().st_size == len(raw):
                return key  # already stored (a short file left by a crash is rewritten)
        except FileNotFoundError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(raw)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return key

    def has(self, key: str) -> bool:
        """Whether ``key`` is stored (a malformed key is simply not stored)."""
        return is_content_key(key) and self.path_for(key).is_file()

    def size(self, key: str) -> int | None:
        """The stored size of ``key`` in bytes, ``None`` when it is not stored (no read, no hashing)."""
        if not is_content_key(key):
            return None
        try:
            return self.path_for(key).stat().st_size
        except OSError:
            return None

    def get(self, key: str) -> bytes:
        """The bytes stored under ``key``, verified against it (see the module docstring)."""
        if not is_content_key(key):
            raise MediaFetchError(f"not a content key: {str(key)[:80]!r}", source=str(key)[:80])
        try:
            raw = self.path_for(key).read_bytes()
        except FileNotFoundError:
            raise MediaFetchError(
                f"media key {key} is not in the store at {self.root}", source=key, retryable=False
            ) from None
        except OSError as exc:
            raise MediaFetchError(f"media key {key}: cannot read the store: {exc}", source=key) from exc
        actual = content_key(raw)
        if actual != key:
            raise MediaError(
                f"media store file for key {key} holds other bytes (sha256 {actual}); refusing them",
                source=key,
            )
        return raw

    def keys(self) -> list[str]:
        """Every stored key (sorted)."""
        return sorted(p.name for p in self.root.glob("??/*") if is_content_key(p.name))

    def __repr__(self) -> str:
        return f"MediaStore({str(self.root)!r}, max_bytes={self.max_bytes})"


def _peer_allowed(address: str, allowed: frozenset[str]) -> bool:
    text = address.split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or str(ip) in allowed


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "gymbridge-media"
    sys_version = ""
    timeout = 30.0  # an idle keep-alive connection closes after this
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("media server: " + format, *args)

    def _plain(self, status: HTTPStatus, text: str, *, body: bool = True, close: bool = False) -> None:
        data = (text + "\n").encode()
        self.send_response(status)
        if close:  # a request body we will not read must not be parsed as the next request
            self.send_header("Connection", "close")
            self.close_connection = True
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        if status == HTTPStatus.METHOD_NOT_ALLOWED:
            self.send_header("Allow", "GET, HEAD, PUT")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _serve(self, *, body: bool) -> None:
        if not _peer_allowed(self.client_address[0], self.server.allowed_peers):
            self._plain(
                HTTPStatus.FORBIDDEN, "only loopback and listed hosts may fetch", body=body, close=True
            )
            return
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/"):
            self._plain(HTTPStatus.OK, "ok", body=body)
            return
        key = path[len(MEDIA_PATH_PREFIX) :] if path.startswith(MEDIA_PATH_PREFIX) else ""
        if not is_content_key(key) or not self.server.store.has(key):
            self._plain(HTTPStatus.NOT_FOUND, "no such media", body=body)
            return
        etag = f'"{key}"'
        if self.headers.get("If-None-Match", "").strip() in (etag, "*"):
            self.send_response(HTTPStatus.NOT_MODIFIED)
            self.send_header("ETag", etag)
            self.send_header("Cache-Control", _IMMUTABLE)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        try:
            raw = self.server.store.get(key)
        except MediaError as exc:
            logger.error("media server: %s", exc)
            self._plain(HTTPStatus.INTERNAL_SERVER_ERROR, "stored media failed verification", body=body)
            return
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", sniff_mime(raw) or "application/octet-stream")
        self.send_header("Content-Length", str(len(raw)))
        self.send_header("ETag", etag)
        self.send_header("Cache-Control", _IMMUTABLE)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if body:
            self.wfile.write(raw)
            self.server.count(len(raw))

    def do_GET(self) -> None:
        self._serve(body=True)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def _refuse_method(self) -> None:
        self._plain(HTTPStatus.METHOD_NOT_ALLOWED, "only GET, HEAD and PUT", close=True)

    def do_PUT(self) -> None:
        """Upload: ``PUT /media/<key>`` stores the body when it hashes to ``key``; answers the key."""
        if not _peer_allowed(self.client_address[0], self.server.allowed_peers):
            self._plain(HTTPStatus.FORBIDDEN, "only loopback and listed hosts may store", close=True)
            return
        path = self.path.split("?", 1)[0]
        key = path[len(MEDIA_PATH_PREFIX) :] if path.startswith(MEDIA_PATH_PREFIX) else ""
        if not is_content_key(key):
            self._plain(HTTPStatus.NOT_FOUND, "PUT only to /media/<content key>", close=True)
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._plain(HTTPStatus.LENGTH_REQUIRED, "Content-Length required", close=True)
            return
        limit = self.server.store.max_bytes or _MAX_UPLOAD_BYTES
        if length <= 0 or length > limit:
            self._plain(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"1..{limit} bytes per medium", close=True)
            return
        raw = self.rfile.read(length)
        if len(raw) != length or content_key(raw) != key:
            self._plain(HTTPStatus.BAD_REQUEST, "the body does not hash to the key in the path")
            return
        existed = self.server.store.has(key)
        try:
            self.server.store.put(raw)
        except (MediaError, OSError) as exc:
            logger.error("media server: upload of %s failed: %s", key, exc)
            self._plain(HTTPStatus.INTERNAL_SERVER_ERROR, "cannot store the medium")
            return
        self._plain(HTTPStatus.OK if existed else HTTPStatus.CREATED, key)

    do_POST = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = False

    def __init__(self, address: tuple[str, int], store: MediaStore, allowed_peers: frozenset[str]) -> None:
        self.store = store
        self.allowed_peers = allowed_peers
        self.requests_served = 0
        self.bytes_served = 0
        self._count_lock = threading.Lock()
        super().__init__(address, _Handler)

    def count(self, nbytes: int) -> None:
        with self._count_lock:
            self.requests_served += 1
            self.bytes_served += nbytes


class MediaServer:
    """``GET /media/<key>`` over a :class:`MediaStore`; see the module docstring.

    ``allowed_peers`` lists IP addresses (besides loopback) that may fetch, e.g. the
    address of an agent on another machine; ``host`` is the bind address and the host
    in :attr:`base_url`.
    """

    def __init__(
        self,
        store: MediaStore,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        allowed_peers: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.store = store
        self.host = host
        self.port = port
        peers: set[str] = set()
        for peer in allowed_peers:
            try:
                peers.add(str(ipaddress.ip_address(peer.strip().strip("[]"))))
            except ValueError as exc:
                raise ValueError(f"allowed_peers entries are IP addresses, got {peer!r}") from exc
        self.allowed_peers = frozenset(peers)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT`` (the bound port; ``start()`` first)."""
        if self._server is None:
            raise RuntimeError("the media server is not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._server.server_address[1]}"

    @property
    def host_entry(self) -> str:
        """``host:port`` of this server, as ``MediaPolicy.media_hosts`` takes it."""
        return self.base_url.split("//", 1)[1]

    def url_for(self, key: str) -> str:
        """The reference for ``key``: ``f"{base_url}/media/{key}"``."""
        if not is_content_key(key):
            raise ValueError(f"not a content key: {str(key)[:80]!r}")
        return f"{self.base_url}{MEDIA_PATH_PREFIX}{key}"

    @property
    def requests_served(self) -> int:
        """Media bodies served (GETs answered 200) since start."""
        return self._server.requests_served if self._server is not None else 0

    @property
    def bytes_served(self) -> int:
        """Media body bytes served since start."""
        return self._server.bytes_served if self._server is not None else 0

    def start(self) -> str:
        """Listen (``port=0``: a free port) and serve in a daemon thread; return :attr:`base_url`."""
        if self._server is not None:
            return self.base_url
        check_port(self.port)
        try:
            server = _Server((self.host, self.port), self.store, self.allowed_peers)
        except OSError as exc:
            raise bind_error(self.host, self.port, exc) from exc
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="gb-media-server", daemon=True
        )
        self._thread.start()
        logger.info("media server over %s listening on %s", self.store.root, self.base_url)
        return self.base_url

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> MediaServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.base_url if self._server is not None else "stopped"
        return f"MediaServer({self.store!r}, {where})"
