"""Fuzz every route of every example environment: no input yields a 5xx, and the server stays up.

Payloads mix random bytes, random JSON, and real rows of the environment with fields
dropped or replaced by random JSON (the shapes that reach deep into ``seed_session``,
tools, ``verify``, ``reset`` and ``step``), sent with and without an
``/ng-rollout/<id>`` prefix and with a seeded session cookie or none. A 5xx here means an
author's code raised on bad input, which stock Gym would also turn into a 500 that
clients retry as an infrastructure fault: every such case must be a 4xx instead.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymbridge_envs import ENVIRONMENTS, get_env
from gymbridge_envs._testing import running

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)

OUTPUT_ITEM = st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])},
    optional={
        "role": st.sampled_from(["assistant", "user"]) | JSON,
        "name": st.sampled_from(["click", "zoom", "answer", "increment_counter", "get_counter_value"]) | JSON,
        "arguments": st.sampled_from(['{"x": 1, "y": 2}', '{"bbox": [0, 0, 9, 9]}', '{"value": "12"}'])
        | st.text(max_size=20)
        | JSON,
        "content": st.lists(
            st.fixed_dictionaries({"type": st.just("output_text"), "text": st.text(max_size=30)})
        )
        | JSON,
        "call_id": st.text(max_size=5),
    },
)


@functools.cache
def real_rows(name: str) -> list[dict[str, Any]]:
    """Two real rows per environment, generated once (mutations work on deep copies)."""
    return list(get_env(name).generate(2, seed=3))


def mutate(row: dict[str, Any], data: st.DataObject) -> Any:
    """A real row with keys dropped / replaced, plus a random ``response`` (for verify and step)."""
    out = copy.deepcopy(row)
    for key in data.draw(st.lists(st.sampled_from(sorted(out)), min_size=1, max_size=3, unique=True)):
        if data.draw(st.booleans()):
            del out[key]
        else:
            out[key] = data.draw(JSON)
    output = data.draw(st.lists(OUTPUT_ITEM, max_size=4) | JSON)
    out["response"] = data.draw(st.sampled_from([{"output": output}, output, {}]))
    return out


def payload(rows: list[dict[str, Any]], data: st.DataObject) -> bytes:
    kind = data.draw(st.sampled_from(["bytes", "json", "row", "row", "row", "row"]))
    if kind == "bytes":
        return data.draw(st.binary(max_size=64))
    if kind == "json":
        return orjson.dumps(data.draw(JSON))
    return orjson.dumps(mutate(data.draw(st.sampled_from(rows)), data))


@pytest.mark.parametrize("name", list(ENVIRONMENTS))
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
async def test_no_input_yields_a_5xx_and_the_server_stays_up(name: str, data: st.DataObject) -> None:
    spec = get_env(name)
    rows = real_rows(name)
    server = spec.make_server()
    routes = [(path, method) for path, methods in server.routes().items() for method in methods]
    routes += [("/no_such_tool", "POST"), ("/verify", "GET")]
    async with (
        running(server) as url,
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http,
    ):
        # one seeded session, so tools / step see real state as well as none
        seed_path = "/reset" if "/reset" in server.routes() else "/seed_session"
        async with http.post(url + seed_path, data=orjson.dumps(rows[0])) as resp:
            assert resp.status == 200, await resp.text()
            cookie = "; ".join(f"{k}={m.value}" for k, m in resp.cookies.items())
        for path, method in routes:  # every route, every example
            prefix = data.draw(st.sampled_from(["", "/ng-rollout/f-1"]))
            headers = {"Cookie": cookie} if data.draw(st.booleans()) else {}
            body = payload(rows, data) if method == "POST" else None
            async with http.request(method, url + prefix + path, data=body, headers=headers) as resp:
                text = await resp.text()
                assert resp.status < 500, f"{method} {prefix}{path} -> {resp.status}: {text[:300]}"
                if resp.status >= 400:
                    orjson.loads(text)  # every error is a JSON body
        async with http.get(url + "/") as resp:
            assert resp.status == 200
