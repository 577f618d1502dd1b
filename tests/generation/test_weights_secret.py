"""The run secret of the weight routes: only the trainer may change a generator's weights.

Every ``/weights/*`` call must carry ``Authorization: Bearer <run secret>``: without it, or with a
wrong one, the server answers 401 and nothing changes (the served model's bytes, its
``/weights/status``); the right one publishes. The secret reaches a child server through its
environment only (never its argv, never its log), ``gymbridge model serve --enable-weight-updates``
refuses to start without one, and the generation routes stay open to agents. The whole-run check
(a ``generator.placement: process`` run's directory) is ``tests/run/test_run_weights_secret.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from gymbridge.errors import WeightSyncError
from gymbridge.generation.cli import main as model_cli
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.server import WEIGHTS_SECRET_ENV, ModelServer, ModelServerConfig
from gymbridge.generation.shared_weights import SHM_DIR
from gymbridge.generation.weights import WeightReceiver
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.run.generator_process import start_model_server_process, tiny_server_command
from gymbridge.trainer.models import tiny_policy
from gymbridge.trainer.weight_sync import DistributedPublisher

pytestmark = pytest.mark.integration

TRANSPORTS = [
    "broadcast",
    pytest.param(
        "shared_memory", marks=pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")
    ),
]
WEIGHT_ROUTES = [("GET", "/weights/status"), ("POST", "/weights/init_group"), ("POST", "/weights/update")]


@dataclass
class Served:
    url: str
    secret: str
    gen: HFGenerator


def snapshot(model: torch.nn.Module) -> dict[str, bytes]:
    """Every parameter and buffer as raw bytes (what "byte-identical" compares)."""
    return {
        k: v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        for k, v in model.state_dict().items()
    }


def nudged(seed: int) -> torch.nn.Module:
    model: torch.nn.Module = tiny_policy(0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    """A model server with a weight sink over a model of its own, guarded by a fresh run secret."""
    gen = HFGenerator(tiny_policy(0), build_tiny_vlm(0).processor, max_model_len=256)
    secret = secrets.token_urlsafe(32)
    config = ModelServerConfig(model_name="tiny", max_model_len=256, default_max_tokens=4, batching=False)
    server = ModelServer(gen, config=config, weight_sink=WeightReceiver(gen), weights_secret=secret)
    url = await server.start()
    try:
        yield Served(url, secret, gen)
    finally:
        await server.stop()


async def status(served: Served) -> dict[str, Any]:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {served.secret}"}) as client:
        reply = await client.get(f"{served.url}/weights/status")
    assert reply.status_code == 200, reply.text
    data: dict[str, Any] = reply.json()
    return data


async def publish(served: Served, secret: str | None, transport: str, version: int) -> None:
    pub = DistributedPublisher(served.url, timeout_s=30, transport=transport, secret=secret)  # type: ignore[arg-type]
    try:
        await asyncio.to_thread(pub.publish, nudged(version), version)
    finally:
        pub.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_push_without_the_secret_or_with_a_wrong_one_is_refused_and_changes_nothing(
    served: Served, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    before = snapshot(served.gen.model)
    wrong = secrets.token_urlsafe(32)
    for secret in (None, wrong):
        with pytest.raises(WeightSyncError, match=r"/weights/\w+ -> 401: .*run secret"):
            await publish(served, secret, transport, 1)
    assert snapshot(served.gen.model) == before  # the stranger's layout was right: only the secret stopped it
    after = await status(served)
    assert after["policy_version"] == 0 and after["syncs"] == 0 and not after["group_ready"]
    assert "401" in caplog.text  # the refusal is logged ...
    assert wrong not in caplog.text and served.secret not in caplog.text  # ... without any token


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_right_secret_publishes(served: Served, transport: str) -> None:
    trainer = nudged(1)
    pub = DistributedPublisher(served.url, timeout_s=30, transport=transport, secret=served.secret)  # type: ignore[arg-type]
    try:
        await asyncio.to_thread(pub.publish, trainer, 1)
        assert pub.transport == transport
        assert (await asyncio.to_thread(pub.status))["policy_version"] == 1
    finally:
        pub.close()
    assert snapshot(served.gen.model) == snapshot(trainer)
    assert (await status(served))["syncs"] == 1


async def test_every_weight_route_answers_401_with_a_typed_body_and_nothing_changes(served: Served) -> None:
    before = snapshot(served.gen.model)
    wrong = "Bearer " + secrets.token_urlsafe(32)
    headers: list[dict[str, str] | dict[bytes, bytes]] = [
        {},
        {"Authorization": wrong},
        {"Authorization": f"Basic {served.secret}"},  # the right value under another scheme
        {"Authorization": f"Bearer {served.secret[:-1]}"},  # a prefix of it
        {"Authorization": "Bearer"},
        {b"Authorization": "Bearer \u00e9\u00e9".encode()},  # not ASCII: refused, not a 500
        {b"Authorization": b"Bearer \xff\xfe"},  # not even UTF-8
    ]
    body = {"version": 1, "buckets": [], "transport": "shared_memory", "segment": 0}
    async with httpx.AsyncClient() as client:
        for prefix in ("", "/ng-rollout/abc"):
            for method, path in WEIGHT_ROUTES:
                for h in headers:
                    reply = await client.request(method, f"{served.url}{prefix}{path}", json=body, headers=h)
                    assert reply.status_code == 401, (path, h, reply.text)
                    error = reply.json()
                    assert error["object"] == "error" and error["type"] == "AuthenticationError"
                    assert error["code"] == 401 and reply.headers["WWW-Authenticate"].startswith("Bearer")
                    assert served.secret not in reply.text and wrong not in reply.text
    assert snapshot(served.gen.model) == before
    assert (await status(served))["policy_version"] == 0


async def test_the_scheme_is_case_insensitive(served: Served) -> None:
    async with httpx.AsyncClient() as client:
        reply = await client.get(
            f"{served.url}/weights/status", headers={"Authorization": f"bearer {served.secret}"}
        )
    assert reply.status_code == 200, reply.text


async def test_generation_routes_stay_open_without_the_secret(served: Served) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0.0}
    async with httpx.AsyncClient(timeout=60) as client:
        for method, path, body in (
            ("GET", "/health", None),
            ("GET", "/v1/models", None),
            ("GET", "/counters", None),
            ("GET", "/media_cache", None),
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2, "temperature": 0.0}),
            ("POST", "/v1/chat/completions", chat),
        ):
            reply = await client.request(method, f"{served.url}{path}", json=body)
            assert reply.status_code == 200, (path, reply.text)


async def test_without_a_weight_sink_the_routes_stay_off_whatever_the_token(tiny_gen: HFGenerator) -> None:
    secret = secrets.token_urlsafe(32)
    config = ModelServerConfig(model_name="tiny", max_model_len=256, batching=False)
    async with (
        ModelServer(tiny_gen, config=config, weights_secret=secret) as server,
        httpx.AsyncClient() as c,
    ):
        for method, path in WEIGHT_ROUTES:
            for h in ({}, {"Authorization": f"Bearer {secret}"}):
                reply = await c.request(method, f"{server.url}{path}", json={}, headers=h)
                assert reply.status_code == 403 and reply.json()["type"] == "PermissionDenied"


def test_a_weight_sink_without_a_secret_or_with_a_short_one_is_refused() -> None:
    gen = HFGenerator(tiny_policy(0), build_tiny_vlm(0).processor, max_model_len=256)
    with pytest.raises(ValueError, match="weights_secret"):
        ModelServer(gen, weight_sink=WeightReceiver(gen))
    with pytest.raises(ValueError, match="at least 16 characters") as info:
        ModelServer(gen, weight_sink=WeightReceiver(gen), weights_secret="short-secret")
    assert "short-secret" not in str(info.value)


def test_model_serve_refuses_to_open_the_weight_routes_without_a_secret(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before the model loads: exit 2, one error line naming the variable (never its value)."""
    monkeypatch.delenv(WEIGHTS_SECRET_ENV, raising=False)
    assert model_cli(["serve", "--tiny", "--enable-weight-updates", "--port", "0"]) == 2
    assert WEIGHTS_SECRET_ENV in capsys.readouterr().err
    monkeypatch.setenv(WEIGHTS_SECRET_ENV, "too-short")
    assert model_cli(["serve", "--tiny", "--enable-weight-updates", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "at least 16" in err and "too-short" not in err
    assert WEIGHTS_SECRET_ENV not in os.environ  # taken out once read: nothing it starts inherits it


def test_a_child_server_gets_the_secret_through_its_environment_only(tmp_path: Path) -> None:
    secret = secrets.token_urlsafe(32)
    command = tiny_server_command(
        seed=0, max_model_len=256, default_max_tokens=4, prompt_seed=None, enable_weight_updates=True
    )
    log = tmp_path / "model_server.log"
    with start_model_server_process(
        command, log_path=log, startup_timeout_s=120, env={WEIGHTS_SECRET_ENV: secret}
    ) as child:
        argv = Path(f"/proc/{child.pid}/cmdline").read_bytes()
        assert b"--enable-weight-updates" in argv and secret.encode() not in argv  # ps shows argv
        assert secret not in os.environ.get(WEIGHTS_SECRET_ENV, "")  # the launcher's own env untouched
        stranger = DistributedPublisher(child.url, timeout_s=30)
        try:
            with pytest.raises(WeightSyncError, match="401"):
                stranger.publish(nudged(1), 1)
        finally:
            stranger.close()
        trainer = DistributedPublisher(child.url, timeout_s=30, secret=secret)
        try:
            trainer.publish(nudged(1), 1)
            assert trainer.status()["policy_version"] == 1
        finally:
            trainer.close()
        reply = httpx.post(
            f"{child.url}/v1/responses", json={"input": "hi", "max_output_tokens": 2}, timeout=60
        )
        assert reply.status_code == 200 and reply.json()["output"][-1]["policy_version"] == 1
    text = log.read_text()
    assert "401" in text and secret not in text


def test_regression_the_weight_store_listens_on_its_host_only() -> None:
    """The trainer's weight-group store listened on every interface (torch's default); it binds its host."""
    psutil = pytest.importorskip("psutil")
    from gymbridge.generation.weights import weight_store

    store = weight_store("127.0.0.1", 0, world_size=2, is_host=True, timeout_s=10)
    client = weight_store("127.0.0.1", store.port, world_size=2, is_host=False, timeout_s=10)
    client.set("k", b"v")
    assert store.get("k") == b"v"
    mine = [c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert [(a.ip, a.port) for a in mine if a.port == store.port] == [("127.0.0.1", store.port)]
