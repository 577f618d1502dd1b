"""Guarded http(s) fetch against a loopback server: allow-list, private hosts on every hop, caps, timeouts."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from media_assets import MediaServer

from gymbridge.errors import MediaFetchError, MediaPolicyError
from gymbridge.media import MediaItem, MediaPolicy, afetch_http, aload_media, fetch_http, load_media
from gymbridge.media import fetch as fetch_mod

pytestmark = pytest.mark.integration

Loader = Callable[[str, MediaPolicy], Any]


def _sync(url: str, policy: MediaPolicy) -> bytes:
    return fetch_http(url, policy)


async def _async(url: str, policy: MediaPolicy) -> bytes:
    return await afetch_http(url, policy)


async def call(loader: str, url: str, policy: MediaPolicy) -> bytes:
    if loader == "sync":
        return _sync(url, policy)
    return await _async(url, policy)


both = pytest.mark.parametrize("loader", ["sync", "async"])


def allow(server: MediaServer, **kw: Any) -> MediaPolicy:
    return MediaPolicy(allowed_http_hosts=(server.host,), **kw)


def redirect(server: MediaServer, to: str, code: int = 302) -> str:
    return server.url(f"/redirect?code={code}&to={quote(to, safe='')}")


@both
async def test_allowed_host_fetch_returns_the_bytes(
    loader: str, media_server: MediaServer, png: bytes
) -> None:
    assert await call(loader, media_server.url("/file?name=img.png"), allow(media_server)) == png


async def test_load_media_and_aload_media_over_http(media_server: MediaServer, png: bytes) -> None:
    url = media_server.url("/file?name=img.png")
    a = load_media(url, "image", allow(media_server))
    b = await aload_media(url, "image", allow(media_server))
    assert a.raw == b.raw == png and a.image().size == (24, 16)


@both
async def test_loopback_is_refused_without_contacting_it(loader: str, media_server: MediaServer) -> None:
    before = len(media_server.requests)
    with pytest.raises(MediaPolicyError, match=r"loopback address 127\.0\.0\.1.*allowed_http_hosts") as info:
        await call(loader, media_server.url("/file?name=img.png"), MediaPolicy())
    assert "127.0.0.1" in str(info.value)
    assert len(media_server.requests) == before


def test_allow_list_entry_with_another_port_does_not_match(media_server: MediaServer) -> None:
    policy = MediaPolicy(allowed_http_hosts=(f"127.0.0.1:{media_server.port + 1}",))
    with pytest.raises(MediaPolicyError, match="loopback"):
        fetch_http(media_server.url("/file?name=img.png"), policy)
    assert fetch_http(media_server.url("/file?name=img.png"), MediaPolicy(allowed_http_hosts=("127.0.0.1",)))


@both
@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://10.1.2.3/x.png", "private"),
        ("http://192.168.0.1/x.png", "private"),
        ("http://[::1]:80/x.png", "loopback"),
        ("http://[::ffff:127.0.0.1]/x.png", "loopback"),
        ("http://[fe80::1]/x.png", "link-local"),
        ("http://0.0.0.0/x.png", "unspecified"),
        ("http://224.0.0.1/x.png", "multicast"),
        ("http://100.64.0.1/x.png", "non-global"),
    ],
)
async def test_private_hosts_are_refused_on_a_redirect_hop(
    loader: str, media_server: MediaServer, target: str, reason: str
) -> None:
    url = redirect(media_server, target)
    with pytest.raises(MediaPolicyError, match=reason) as info:
        await call(loader, url, allow(media_server))
    message = str(info.value)
    assert "redirect hop" in message and target[:20] in message


@both
async def test_redirect_to_localhost_by_name_is_refused(loader: str, media_server: MediaServer) -> None:
    # the first hop is allowed (127.0.0.1:port); "localhost" is not in the list and resolves to loopback
    target = f"http://localhost:{media_server.port}/file?name=img.png"
    before = len(media_server.requests)
    with pytest.raises(MediaPolicyError, match="loopback"):
        await call(loader, redirect(media_server, target), allow(media_server))
    assert len(media_server.requests) == before + 1  # only the allowed first hop was contacted


@both
@pytest.mark.parametrize("target", ["file:///etc/passwd", "ftp://example.com/x", "gopher://x/"])
async def test_redirect_to_another_scheme_is_refused(
    loader: str, media_server: MediaServer, target: str
) -> None:
    with pytest.raises(MediaPolicyError, match="is not allowed"):
        await call(loader, redirect(media_server, target), allow(media_server))


@both
async def test_allowed_redirect_chain_is_followed(loader: str, media_server: MediaServer, png: bytes) -> None:
    inner = redirect(media_server, media_server.url("/file?name=img.png"), code=307)
    assert await call(loader, redirect(media_server, inner, code=301), allow(media_server)) == png


@both
async def test_redirect_loop_stops_at_max_redirects(loader: str, media_server: MediaServer) -> None:
    url = redirect(media_server, "/redirect?to=%2Fredirect%3Fto%3D%252Fstatus%253Fcode%253D200")
    with pytest.raises(MediaFetchError, match="max_redirects=1") as info:
        await call(loader, url, allow(media_server, max_redirects=1))
    assert info.value.retryable is False


@both
@pytest.mark.parametrize(
    ("code", "retryable"), [(404, False), (403, False), (500, True), (503, True), (429, True)]
)
async def test_http_errors_carry_retryable(
    loader: str, media_server: MediaServer, code: int, retryable: bool
) -> None:
    with pytest.raises(MediaFetchError, match=f"HTTP {code}") as info:
        await call(loader, media_server.url(f"/status?code={code}"), allow(media_server))
    assert info.value.retryable is retryable


@both
async def test_timeout_is_retryable_and_bounded(loader: str, media_server: MediaServer) -> None:
    start = time.monotonic()
    with pytest.raises(MediaFetchError, match=r"fetch_timeout_s=0\.5") as info:
        await call(loader, media_server.url("/slow?s=200"), allow(media_server, fetch_timeout_s=0.5))
    assert info.value.retryable is True
    assert time.monotonic() - start < 20  # wallclock-ok: the deadline fired; the server answers after 200 s


@both
async def test_slow_drip_body_cannot_stretch_the_deadline(loader: str, media_server: MediaServer) -> None:
    start = time.monotonic()
    with pytest.raises(MediaFetchError, match=r"fetch_timeout_s=0\.8"):
        await call(loader, media_server.url("/drip"), allow(media_server, fetch_timeout_s=0.8))
    assert time.monotonic() - start < 20  # wallclock-ok: the deadline fired; the drip takes 200 s


@both
async def test_regression_slow_drip_headers_cannot_stretch_the_deadline(
    loader: str, media_server: MediaServer
) -> None:
    """Headers dripped one line per 0.2 s: every socket read succeeds within the per-read timeout,
    so only a deadline over the whole fetch stops it (the sync path used to hang for 200 s)."""
    start = time.monotonic()
    with pytest.raises(MediaFetchError, match=r"fetch_timeout_s=0\.8") as info:
        await call(loader, media_server.url("/driphead"), allow(media_server, fetch_timeout_s=0.8))
    assert info.value.retryable is True
    assert time.monotonic() - start < 20  # wallclock-ok: the deadline fired; the drip takes 200 s


@both
async def test_declared_oversize_body_is_refused_before_reading(
    loader: str, media_server: MediaServer
) -> None:
    with pytest.raises(MediaPolicyError, match=r"Content-Length 1000000000000 is over max_encoded_bytes"):
        await call(loader, media_server.url("/big"), allow(media_server))


@both
async def test_streamed_body_is_cut_at_the_cap(loader: str, media_server: MediaServer) -> None:
    with pytest.raises(MediaPolicyError, match="body is over max_encoded_bytes=100000"):
        await call(loader, media_server.url("/chunked"), allow(media_server, max_encoded_bytes=100_000))


@both
async def test_connection_refused_is_retryable(loader: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(MediaFetchError, match="transport error") as info:
        await call(
            loader, f"http://127.0.0.1:{port}/x", MediaPolicy(allowed_http_hosts=(f"127.0.0.1:{port}",))
        )
    assert info.value.retryable is True


def _fake_dns(monkeypatch: pytest.MonkeyPatch, table: dict[str, list[str]]) -> None:
    real = socket.getaddrinfo

    def fake(host: str, port: int, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        if host in table:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in table[host]]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)


@both
async def test_public_name_resolving_to_a_private_address_is_refused(
    loader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_dns(monkeypatch, {"evil.example": ["93.184.216.34", "10.0.0.7"]})
    with pytest.raises(MediaPolicyError, match=r"'evil\.example' resolves to private address 10\.0\.0\.7"):
        await call(loader, "http://evil.example/x.png", MediaPolicy())


@both
async def test_request_goes_to_the_checked_address_with_the_original_host_header(
    loader: str, media_server: MediaServer, png: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DNS-rebinding guard: the connection uses the address that passed the check.

    The fake resolver answers the checked address once, then a different one (as a
    rebinding attacker would); a client that resolved again would connect elsewhere.
    """
    lookups: list[str] = []
    real = socket.getaddrinfo

    def rebinding(host: str, port: int, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        if host != "media.example":
            return real(host, port, *args, **kwargs)
        lookups.append(host)
        ip = "127.0.0.1" if len(lookups) == 1 else "203.0.113.9"  # TEST-NET-3: unroutable
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.setattr(fetch_mod, "check_address", lambda address: None)  # pretend loopback is public
    url = f"http://media.example:{media_server.port}/file?name=img.png"
    assert await call(loader, url, MediaPolicy(fetch_timeout_s=3.0)) == png
    assert lookups == ["media.example"]  # resolved once, by the guard
    assert media_server.requests[-1] == ("/file?name=img.png", f"media.example:{media_server.port}")


def test_unresolvable_host_is_a_fetch_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    with pytest.raises(MediaFetchError, match="cannot resolve host") as info:
        fetch_http("http://nowhere.invalid/x.png", MediaPolicy())
    assert info.value.retryable is False


def test_from_ref_refuses_literal_private_addresses_without_io() -> None:
    for url in ("http://127.0.0.1/x.png", "http://[::1]/x.png", "https://169.254.169.254/"):
        with pytest.raises(MediaPolicyError):
            MediaItem.from_ref(url, "image")
    lazy = MediaItem.from_ref("https://images.example/x.png", "image")  # names resolve at fetch time
    assert not lazy.loaded


def test_check_address_classifies() -> None:
    assert fetch_mod.check_address("8.8.8.8") is None
    assert fetch_mod.check_address("2606:4700:4700::1111") is None
    assert fetch_mod.check_address("127.0.0.5") == "loopback"
    assert fetch_mod.check_address("172.16.0.1") == "private"
    assert fetch_mod.check_address("fc00::1") == "private"
    assert fetch_mod.check_address("2002:7f00:1::") == "loopback"  # 6to4 wrapping 127.0.0.1


def test_regression_ipv6_site_local_is_refused() -> None:
    """``fec0::/10`` (deprecated site-local, still routed inside some private networks) passed as
    public: Python's ``is_global`` / ``is_private`` do not cover it."""
    assert fetch_mod.check_address("fec0::1") == "site-local"
    assert fetch_mod.check_address("feff:ffff::1") == "site-local"
    with pytest.raises(MediaPolicyError, match="site-local address"):
        MediaItem.from_ref("http://[fec0::1]/x.png", "image")


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """An https server on 127.0.0.1 whose self-signed certificate names only ``media.example``."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    command = [
        *("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
        *("-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "2"),
        *("-subj", "/CN=media.example", "-addext", "subjectAltName=DNS:media.example"),
    ]
    subprocess.run(
        command,
        check=True,
        capture_output=True,
        timeout=30,
    )

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "cert.pem", d / "key.pem")
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield server.server_address[1], d / "cert.pem"
    finally:
        server.shutdown()
        server.server_close()


def test_https_to_the_pinned_address_still_verifies_the_certificate_name(
    tls_server: tuple[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection goes to the checked IP, but TLS (SNI + hostname check) uses the URL's name."""
    port, cert = tls_server
    _fake_dns(monkeypatch, {"media.example": ["127.0.0.1"]})
    monkeypatch.setattr(fetch_mod, "check_address", lambda address: None)
    with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), trust_env=False) as client:
        assert fetch_http(f"https://media.example:{port}/x", MediaPolicy(), client=client) == b"ok"
        # the same server reached by its address fails verification: the name check is real
        with pytest.raises(MediaFetchError, match="CERTIFICATE_VERIFY_FAILED"):
            fetch_http(f"https://127.0.0.1:{port}/x", MediaPolicy(), client=client)
