"""Fixtures for the server SDK tests: running servers on free loopback ports."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from gymbridge.server import RunningServer, start_server
from gymbridge.server.examples import CounterEnv, StepCounterEnv


@pytest.fixture
async def counter_env() -> AsyncIterator[RunningServer]:
    server = await start_server(CounterEnv())
    yield server
    await server.stop()


@pytest.fixture
async def step_env() -> AsyncIterator[RunningServer]:
    server = await start_server(StepCounterEnv())
    yield server
    await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        yield session
