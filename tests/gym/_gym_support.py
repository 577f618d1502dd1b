"""Shared helpers of the gym suite (imported by conftest.py and the test modules).

Role: the in-process side of the fixtures: an asyncio loop in a daemon thread for servers that
outlive one test's event loop, the named-script dispatcher the shared scripted model answers from,
how a stack names that model, and the counter scripts and row tagging several test modules use.
Kept out of ``conftest.py`` because several ``conftest`` modules exist in the repo and
``import conftest`` would be ambiguous.

Invariants: a request picks its script by ``metadata.script`` only (never by arrival order), so
concurrent tests and concurrent rollouts never share a script; an unknown script name answers a
scripted 500 naming it, never a silent default.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _genuine import KIND_AGENTS, KIND_ENV_SERVERS, KIND_MODELS, KIND_RESOURCES, GenuineStack, ref

MODEL_NAME = "policy_model"


class ScriptBook:
    """Named scripts for the shared scripted model; requests pick one by ``metadata.script``."""

    def __init__(self) -> None:
        self.scripts: dict[str, list[Any] | Callable[[dict[str, Any]], Any]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, script: list[Any] | Callable[[dict[str, Any]], Any]) -> str:
        with self._lock:
            self.scripts[name] = script
        return name

    def __call__(self, body: dict[str, Any]) -> Any:
        from gymbridge.testing.scripted_model import call_index

        metadata = body.get("metadata") or {}
        name = metadata.get("script") if isinstance(metadata, dict) else None
        script = self.scripts.get(str(name))
        if script is None:
            return {"status": 500, "body": f"no script registered as {name!r} (metadata={metadata!r})"}
        if callable(script):
            return script(body)
        return script[min(call_index(body), len(script) - 1)]


class ThreadedLoop:
    """An asyncio loop in a daemon thread, for in-process servers that outlive one test's loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gym-fixture-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout_s: float = 30.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def model_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def add_scripted_model(stack: GenuineStack, url: str) -> None:
    """Name gymbridge's scripted model in a genuine config as ``policy_model`` (not launched)."""
    stack.add(MODEL_NAME, KIND_MODELS, "vllm_model", port=model_port(url), launch=False)


def add_genuine_simple_agent(stack: GenuineStack, name: str, resources: str, **config: Any) -> None:
    """A genuine ``simple_agent`` named ``name`` in front of resources server ``resources``.

    Its policy is the scripted model (:func:`add_scripted_model` names it); ``config`` adds
    agent settings such as ``max_steps``.
    """
    stack.add(
        name,
        KIND_AGENTS,
        "simple_agent",
        resources_server=ref(KIND_RESOURCES, resources),
        model_server=ref(KIND_MODELS, MODEL_NAME),
        **config,
    )


@contextmanager
def genuine_relay_to_our_agent(
    loop: ThreadedLoop, resources_url: str, model_url: str, logs: Path
) -> Iterator[GenuineStack]:
    """Our ``SimpleAgent`` (``ours_agent``, in ``loop``) in front of ``resources_url``, behind a
    genuine ``legacy_agent`` environment-server relay (``ours_env_server``); stops both after."""
    import gymbridge.server as server_sdk

    agent = loop.run(
        server_sdk.start_server(
            server_sdk.SimpleAgent(
                resources_url=resources_url, model_url=model_url, instance_name="ours_agent"
            )
        )
    )
    stack = GenuineStack(logs)
    stack.add("ours_agent", KIND_AGENTS, "simple_agent", port=agent.port, launch=False)
    stack.add(
        "ours_env_server",
        KIND_ENV_SERVERS,
        "legacy_agent",
        agent_server={"type": KIND_AGENTS, "name": "ours_agent"},
    )
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()
        loop.run(agent.stop())


def counter_script(increments: list[int], expected: int) -> list[Any]:
    """The oracle for a counter row: one ``increment_counter`` per increment, a read, the answer."""
    return [
        *({"calls": [{"name": "increment_counter", "arguments": {"count": k}}]} for k in increments),
        {"calls": [{"name": "get_counter_value", "arguments": {}}]},
        f"The count is {expected}.",
    ]


def scripted(row: dict[str, Any], name: str) -> dict[str, Any]:
    """A copy of ``row`` whose model calls answer from script ``name`` (``metadata.script``)."""
    row = copy.deepcopy(row)
    row["responses_create_params"]["metadata"] = {"script": name}
    return row
