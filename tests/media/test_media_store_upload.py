"""``PUT /media/<key>``: an agent stores a tool's image; only bytes that hash to the key are kept."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymbridge.media import store as store_mod
from gymbridge.media.store import MediaServer, MediaStore


@pytest.fixture
def server(tmp_path: Path) -> Iterator[MediaServer]:
    with MediaServer(MediaStore(tmp_path / "media", max_bytes=4096)) as srv:
        yield srv


def _put(server: MediaServer, key: str, body: bytes) -> httpx.Response:
    return httpx.put(f"{server.base_url}/media/{key}", content=body, trust_env=False)


def test_upload_stores_under_the_content_key_once(server: MediaServer) -> None:
    body = b"\x89PNG\r\n\x1a\n" + b"pixels"
    key = hashlib.sha256(body).hexdigest()
    first = _put(server, key, body)
    assert first.status_code == 201 and first.text.strip() == key
    again = _put(server, key, body)
    assert again.status_code == 200 and again.text.strip() == key
    assert server.store.get(key) == body
    got = httpx.get(server.url_for(key), trust_env=False)
    assert got.content == body and got.headers["content-type"] == "image/png"


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(min_size=1, max_size=256), other=st.binary(min_size=1, max_size=256))
def test_upload_under_another_key_is_refused_and_not_stored(
    server: MediaServer, body: bytes, other: bytes
) -> None:
    key = hashlib.sha256(other).hexdigest()
    if body == other:
        return
    reply = _put(server, key, body)
    assert reply.status_code == 400
    assert not server.store.has(key) or server.store.get(key) == other


def test_upload_limits_and_paths(server: MediaServer) -> None:
    big = b"x" * 5000
    assert _put(server, hashlib.sha256(big).hexdigest(), big).status_code == 413
    assert httpx.put(f"{server.base_url}/other", content=b"x", trust_env=False).status_code == 404
    assert _put(server, "ab" * 10, b"x").status_code == 404
    assert httpx.delete(server.url_for("0" * 64), trust_env=False).status_code == 405


def test_upload_from_a_peer_outside_loopback_and_the_list_gets_403(
    server: MediaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_mod, "_peer_allowed", lambda address, allowed: False)
    body = b"data"
    key = hashlib.sha256(body).hexdigest()
    assert _put(server, key, body).status_code == 403
    assert not server.store.has(key)
