"""The content-addressed media store, its HTTP server, and fetching references by key."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.errors import MediaError, MediaFetchError, MediaPolicyError
from gymbridge.media import MediaItem, MediaPolicy, afetch_http, fetch_http
from gymbridge.media import store as store_mod
from gymbridge.media.store import MediaServer, MediaStore, is_content_key, parse_media_ref

both = pytest.mark.parametrize("loader", ["sync", "async"])


async def call(loader: str, url: str, policy: MediaPolicy) -> bytes:
    if loader == "sync":
        return fetch_http(url, policy)
    return await afetch_http(url, policy)


@pytest.fixture
def store(tmp_path: Path) -> MediaStore:
    return MediaStore(tmp_path / "media")


@pytest.fixture
def server(store: MediaStore) -> Iterator[MediaServer]:
    with MediaServer(store) as srv:
        yield srv


# ----------------------------------------------------------------------------- the store


def test_put_returns_the_sha256_and_stores_once(store: MediaStore, png: bytes) -> None:
    key = store.put(png)
    assert key == hashlib.sha256(png).hexdigest()
    assert (store.root / key[:2] / key).read_bytes() == png
    mtime = (store.root / key[:2] / key).stat().st_mtime_ns
    assert store.put(bytearray(png)) == key  # idempotent, any bytes-like
    assert (store.root / key[:2] / key).stat().st_mtime_ns == mtime
    assert store.has(key) and store.get(key) == png
    assert store.keys() == [key]
    assert not any(p.name.endswith(".tmp") for p in store.root.rglob("*"))


def test_corrupt_store_file_is_refused_not_served(store: MediaStore, png: bytes) -> None:
    key = store.put(png)
    path = store.path_for(key)
    path.write_bytes(png[:-1] + bytes([png[-1] ^ 1]))
    with pytest.raises(MediaError, match="other bytes"):
        store.get(key)


def test_truncated_store_file_is_rewritten_by_put(store: MediaStore, png: bytes) -> None:
    key = store.put(png)
    store.path_for(key).write_bytes(png[:10])  # what a crash mid-write could leave
    assert store.put(png) == key
    assert store.get(key) == png


def test_unknown_and_malformed_keys(store: MediaStore) -> None:
    with pytest.raises(MediaFetchError) as info:
        store.get("0" * 64)
    assert info.value.retryable is False
    with pytest.raises(MediaFetchError, match="not a content key"):
        store.get("../../etc/passwd")
    assert not store.has("../x") and not store.has("A" * 64)
    with pytest.raises(ValueError, match="not a content key"):
        store.path_for("ab/../" + "0" * 58)


def test_store_limits(tmp_path: Path) -> None:
    small = MediaStore(tmp_path, max_bytes=10)
    with pytest.raises(MediaPolicyError, match="max_bytes=10"):
        small.put(b"x" * 11)
    with pytest.raises(MediaPolicyError, match="empty"):
        small.put(b"")
    with pytest.raises(TypeError):
        small.put("text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        MediaStore(tmp_path, max_bytes=0)


# ----------------------------------------------------------------------------- references


@given(st.binary(min_size=1, max_size=64), st.integers(min_value=1, max_value=65535))
def test_url_for_and_parse_media_ref_round_trip(data: bytes, port: int) -> None:
    key = hashlib.sha256(data).hexdigest()
    assert is_content_key(key)
    for url in (
        f"http://127.0.0.1:{port}/media/{key}",
        f"https://media.example:{port}/prefix/media/{key}",
        f"http://[::1]:{port}/media/{key}",
    ):
        assert parse_media_ref(url) == key


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,AAAA",
        "/tmp/media/" + "a" * 64,
        "file:///media/" + "a" * 64,
        "http://h/media/" + "A" * 64,  # keys are lower-case
        "http://h/media/" + "a" * 63,
        "http://h/media/" + "a" * 64 + "/x",
        "http://h/xmedia/" + "a" * 64,
        "ftp://h/media/" + "a" * 64,
        "http:///media/" + "a" * 64,
        "http://[/media/" + "a" * 64,
    ],
)
def test_parse_media_ref_refuses_non_references(url: str) -> None:
    assert parse_media_ref(url) is None


# ----------------------------------------------------------------------------- the server


def test_get_and_head_serve_the_bytes_with_immutable_headers(
    server: MediaServer, store: MediaStore, png: bytes
) -> None:
    key = store.put(png)
    url = server.url_for(key)
    assert url == f"{server.base_url}/media/{key}" and parse_media_ref(url) == key
    with httpx.Client(trust_env=False) as http:
        got = http.get(url)
        assert got.status_code == 200 and got.content == png
        assert got.headers["content-type"] == "image/png"
        assert "immutable" in got.headers["cache-control"]
        assert got.headers["etag"] == f'"{key}"'
        head = http.head(url)
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == str(len(png))
        assert http.get(url, headers={"If-None-Match": f'"{key}"'}).status_code == 304
        assert http.get(f"{server.base_url}/media/{'0' * 64}").status_code == 404
        assert http.get(f"{server.base_url}/media/../../etc/passwd").status_code == 404
        assert http.get(f"{server.base_url}/other").status_code == 404
        assert http.post(url, content=b"x").status_code == 405
        assert http.get(f"{server.base_url}/health").status_code == 200
    assert server.requests_served == 1 and server.bytes_served == len(png)  # one GET with a body


def test_a_peer_outside_loopback_and_the_list_gets_403(
    server: MediaServer, store: MediaStore, png: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = store.put(png)
    seen: list[str] = []

    def refuse(address: str, allowed: frozenset[str]) -> bool:
        seen.append(address)
        return False

    monkeypatch.setattr(store_mod, "_peer_allowed", refuse)
    got = httpx.get(server.url_for(key), trust_env=False)
    assert got.status_code == 403 and png not in got.content
    assert seen == ["127.0.0.1"]


def test_peer_rule() -> None:
    allowed = frozenset({"10.0.0.7"})
    assert store_mod._peer_allowed("127.0.0.1", allowed)
    assert store_mod._peer_allowed("::1", allowed)
    assert store_mod._peer_allowed("::ffff:127.0.0.1", allowed)
    assert store_mod._peer_allowed("10.0.0.7", allowed)
    assert not store_mod._peer_allowed("10.0.0.8", allowed)
    assert not store_mod._peer_allowed("8.8.8.8", allowed)
    assert not store_mod._peer_allowed("not-an-ip", allowed)
    with pytest.raises(ValueError, match="IP addresses"):
        MediaServer(MediaStore.__new__(MediaStore), allowed_peers=["host.example"])


def test_a_corrupt_file_answers_500_not_wrong_bytes(
    server: MediaServer, store: MediaStore, png: bytes
) -> None:
    key = store.put(png)
    store.path_for(key).write_bytes(b"not the png")
    got = httpx.get(server.url_for(key), trust_env=False)
    assert got.status_code == 500 and b"not the png" not in got.content


def test_stop_is_idempotent_and_frees_the_port(store: MediaStore) -> None:
    srv = MediaServer(store)
    with pytest.raises(RuntimeError, match="not started"):
        _ = srv.base_url
    srv.start()
    url = srv.base_url
    srv.stop()
    srv.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", trust_env=False, timeout=2)


# ----------------------------------------------------------------------------- fetching by key


@both
async def test_a_reference_fetches_under_media_hosts(
    loader: str, server: MediaServer, store: MediaStore, png: bytes
) -> None:
    key = store.put(png)
    url = server.url_for(key)
    with pytest.raises(MediaPolicyError, match="loopback"):
        await call(loader, url, MediaPolicy())
    policy = MediaPolicy(media_hosts=(server.host_entry,))
    assert await call(loader, url, policy) == png
    item = MediaItem.from_ref(url, "image", policy)
    assert item.key == key and item.image().size[0] > 0


@both
async def test_a_media_host_serves_only_references(loader: str, server: MediaServer) -> None:
    policy = MediaPolicy(media_hosts=(server.host_entry,))
    with pytest.raises(MediaPolicyError, match="serves only"):
        await call(loader, f"{server.base_url}/health", policy)
    plain = MediaPolicy(media_hosts=(server.host_entry,), allowed_http_hosts=(server.host_entry,))
    assert await call(loader, f"{server.base_url}/health", plain) == b"ok\n"


@both
async def test_media_size_limits_apply_to_references(
    loader: str, server: MediaServer, store: MediaStore, png: bytes
) -> None:
    key = store.put(png)
    policy = MediaPolicy(media_hosts=(server.host_entry,), max_encoded_bytes=len(png) - 1)
    with pytest.raises(MediaPolicyError, match="max_encoded_bytes"):
        await call(loader, server.url_for(key), policy)


class _Rogue:
    """A server on a 'media host' that answers wrong bytes or redirects elsewhere."""

    def __init__(self, body: bytes, redirect_to: str | None = None) -> None:
        rogue = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                if rogue.redirect_to is not None and self.path.startswith("/media/"):
                    self.send_response(302)
                    self.send_header("Location", rogue.redirect_to)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(rogue.body)))
                self.end_headers()
                self.wfile.write(rogue.body)

        self.body = body
        self.redirect_to = redirect_to
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.entry = f"127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def rogue(png: bytes) -> Iterator[_Rogue]:
    srv = _Rogue(b"these are not the bytes")
    yield srv
    srv.close()


@both
async def test_media_host_serving_wrong_bytes_is_a_media_error(
    loader: str, rogue: _Rogue, png: bytes
) -> None:
    key = hashlib.sha256(png).hexdigest()
    url = f"http://{rogue.entry}/media/{key}"
    policy = MediaPolicy(media_hosts=(rogue.entry,))
    with pytest.raises(MediaError, match="not the referenced key"):
        await call(loader, url, policy)
    with pytest.raises(MediaError):
        _ = MediaItem.from_ref(url, "image", policy).raw
    # a host that is merely allowed (not a media host) is not verified: same bytes load
    assert await call(loader, url, MediaPolicy(allowed_http_hosts=(rogue.entry,))) == rogue.body


@both
async def test_no_redirect_off_the_media_host(loader: str, rogue: _Rogue, png: bytes) -> None:
    other = _Rogue(png)
    try:
        key = hashlib.sha256(png).hexdigest()
        rogue.redirect_to = f"http://{other.entry}/media/{key}"
        policy = MediaPolicy(media_hosts=(rogue.entry,), allowed_http_hosts=(other.entry,))
        with pytest.raises(MediaPolicyError, match="redirect off the media store"):
            await call(loader, f"http://{rogue.entry}/media/{key}", policy)
        # a redirect within media stores keeps the original key: the body is verified against it
        both_media = MediaPolicy(media_hosts=(rogue.entry, other.entry))
        assert await call(loader, f"http://{rogue.entry}/media/{key}", both_media) == png
        other.body = b"other bytes"
        with pytest.raises(MediaError, match="not the referenced key"):
            await call(loader, f"http://{rogue.entry}/media/{key}", both_media)
    finally:
        other.close()


def test_is_media_host_matches_host_and_port() -> None:
    policy = MediaPolicy(max_pixels=1000, media_hosts=("127.0.0.1:8000",))
    assert policy.is_media_host("127.0.0.1", 8000) and not policy.is_media_host("127.0.0.1", 8001)
