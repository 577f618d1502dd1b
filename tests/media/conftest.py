"""Media test fixtures: session-scoped assets and a loopback HTTP server.

The HTTP server is a threaded ``http.server`` on a free
127.0.0.1 port; it serves both sync and async fetch tests without sharing the
test's event loop, and records every request it receives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from media_assets import MediaServer, audio_bytes, mp4_bytes, png_bytes


@pytest.fixture(scope="session")
def png() -> bytes:
    return png_bytes()


@pytest.fixture(scope="session")
def mp4() -> bytes:
    return mp4_bytes()


@pytest.fixture(scope="session")
def wav() -> bytes:
    return audio_bytes("WAV")


@pytest.fixture(scope="session")
def flac() -> bytes:
    return audio_bytes("FLAC")


# ----------------------------------------------------------------------------- HTTP server


@pytest.fixture(scope="module")
def media_server(png: bytes) -> Iterator[MediaServer]:
    state = MediaServer(port=0, files={"img.png": png})
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # keep test output clean
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            state.requests.append((self.path, self.headers.get("Host")))
            parts = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(parts.query).items()}
            if parts.path == "/file" and query.get("name") in state.files:
                self._send(200, state.files[query["name"]], {"Content-Type": "image/png"})
            elif parts.path == "/redirect":
                self._send(int(query.get("code", "302")), b"", {"Location": query["to"]})
            elif parts.path == "/status":
                self._send(int(query["code"]), b"nope")
            elif parts.path == "/slow":
                stop.wait(float(query.get("s", "5")))
                self._send(200, b"late")
            elif parts.path == "/drip":
                # a body that never ends in time: one byte every 0.2 s
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                for _ in range(1000):
                    if stop.is_set():
                        return
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            elif parts.path == "/driphead":
                # headers that never end: one header line every 0.2 s (each read succeeds in time)
                try:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                    self.wfile.flush()
                    for i in range(1000):
                        if stop.is_set():
                            return
                        self.wfile.write(f"X-Drip-{i}: x\r\n".encode())
                        self.wfile.flush()
                        time.sleep(0.2)
                except OSError:
                    return
            elif parts.path == "/big":
                # declares a huge body; the client must refuse before reading it
                self.send_response(200)
                self.send_header("Content-Length", str(10**12))
                self.end_headers()
                self.wfile.write(b"\x00" * 1024)
            elif parts.path == "/chunked":
                # no Content-Length: a stream that exceeds any small cap
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = b"\x00" * 4096
                try:
                    for _ in range(256):
                        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    return
            else:
                self._send(404, b"not found")

    class QuietServer(ThreadingHTTPServer):
        def handle_error(self, request: object, client_address: object) -> None:
            pass  # clients hanging up mid-body (caps, timeouts) are the point of several tests

    server = QuietServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
