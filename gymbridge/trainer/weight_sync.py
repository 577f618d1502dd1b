"""Weight publication: after every optimizer step the trainer hands its weights to the generator.

A :class:`WeightPublisher` publishes the trainer's model as policy version ``v`` (an int,
0 = the initial weights, then one per optimizer step) and reports the seconds it spent.
Two implementations:

* :class:`InProcessPublisher` (``generator.placement: in_process``): the generator owns a
  model object of its own in the trainer's process; the trainer's parameters and buffers are
  copied into it in place, under the generator's weights lock, and then the generator's
  ``policy_version`` is set. A generator that *shares* the trainer's model object only gets
  its version advanced.
* :class:`DistributedPublisher` (``generator.placement: process``): the generator is a model
  server in another process. Control goes over the server's HTTP routes
  (``POST /weights/init_group``, ``POST /weights/update``; refused unless the server was
  started with ``--enable-weight-updates``); the tensors go over a private torch.distributed
  group (gloo on CPU, NCCL on CUDA; :mod:`gymbridge.generation.weights`) as broadcasts of
  bounded flat buckets, one bucket in memory at a time. The server answers an update with
  202 once it has checked the layout and is waiting for the buckets, and marks the version
  loaded in the group's store; :meth:`DistributedPublisher.publish` returns after that mark.

Invariants: versions only go up (publishing an older version is refused); a publish either
loads the whole version or raises :class:`~gymbridge.errors.WeightSyncError` (a generation
never runs on half-copied weights: the receiver holds the generator's weights lock while it
copies); a layout mismatch (names, shapes, dtypes) is refused before any tensor moves.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

import torch

from gymbridge.errors import WeightSyncError
from gymbridge.generation.weights import (
    DEFAULT_BUCKET_BYTES,
    Backend,
    WeightGroup,
    WeightTarget,
    bucket_tensors,
    check_layout,
    loaded_key,
    named_weights,
    open_weight_group,
    plan_buckets,
    weight_store,
)

logger = logging.getLogger(__name__)

__all__ = ["DistributedPublisher", "InProcessPublisher", "WeightPublisher", "copy_weights"]


class WeightPublisher(Protocol):
    """Publishes the trainer's weights as one policy version (see the module docstring)."""

    def publish(self, model: Any, version: int) -> float:
        """Make ``model``'s current weights the generator's, as ``version``; returns seconds spent."""
        ...

    def close(self) -> None:
        """Release what the publisher holds (connections, groups); idempotent."""
        ...


def copy_weights(source: Any, target: Any) -> int:
    """Copy ``source``'s weights into ``target``'s own tensors in place; returns how many entries.

    Both models must have the same layout (:func:`~gymbridge.generation.weights.check_layout`),
    else :class:`WeightSyncError` lists every mismatch and nothing is copied.
    """
    from gymbridge.generation.weights import TensorSpec

    named = named_weights(source)
    specs = [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named]
    problems = check_layout(specs, target)
    if problems:
        raise WeightSyncError(
            "the generator's model does not match the trainer's: " + "; ".join(problems[:8])
        )
    own = target.state_dict()
    with torch.no_grad():
        for name, tensor in named:
            own[name].copy_(tensor)
    return len(named)


class InProcessPublisher:
    """Publish into a generator in this process that owns its own model (``HFGenerator``)."""

    def __init__(self, generator: WeightTarget) -> None:
        self.generator = generator
        self.syncs = 0

    def publish(self, model: Any, version: int) -> float:
        started = time.perf_counter()
        if version < self.generator.policy_version:
            raise WeightSyncError(
                f"policy version {version} is older than the generator's {self.generator.policy_version}"
            )
        with self.generator.weights_lock:
            if self.generator.model is not model:
                copy_weights(model, self.generator.model)
            self.generator.policy_version = version
        self.syncs += 1
        return time.perf_counter() - started

    def close(self) -> None:
        return None


def _default_backend(model: Any) -> Backend:
    first = next(iter(model.parameters()), None)
    on_gpu = first is not None and first.device.type == "cuda"
    return "nccl" if on_gpu and torch.distributed.is_nccl_available() else "gloo"


class DistributedPublisher:
    """Publish to a model server in another process (see the module docstring).

    ``url`` is the server's base URL. The group is set up on the first :meth:`publish` (or
    :meth:`connect`): the trainer hosts the group's store on ``host`` (127.0.0.1 by default) on
    a free port and is rank 0; the server's ranks follow. ``bucket_bytes`` bounds each
    broadcast; ``timeout_s`` bounds joining, each broadcast and each HTTP call.
    """

    def __init__(
        self,
        url: str,
        *,
        host: str = "127.0.0.1",
        backend: Backend | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 120.0,
    ) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.host = host
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._http = httpx.Client(timeout=timeout_s)
        self._store: Any = None
        self._group: WeightGroup | None = None
        self.version: int | None = None
        self.syncs = 0
        self.last_sync_s = 0.0

    # ------------------------------------------------------------------ control

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        try:
            reply = self._http.post(f"{self.url}{path}", json=body)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"POST {self.url}{path} failed: {exc}") from exc
        if reply.status_code not in (200, 202):
            try:
                message = reply.json().get("message", reply.text)
            except ValueError:
                message = reply.text
            raise WeightSyncError(f"POST {self.url}{path} -> {reply.status_code}: {message}")
        data = reply.json()
        return data if isinstance(data, dict) else {}

    def status(self) -> dict[str, Any]:
        """The server's ``GET /weights/status`` (``policy_version``, ``ranks``, ``syncs``, ...)."""
        import httpx

        try:
            reply = self._http.get(f"{self.url}/weights/status")
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"GET {self.url}/weights/status failed: {exc}") from exc
        if reply.status_code != 200:
            raise WeightSyncError(f"GET {self.url}/weights/status -> {reply.status_code}: {reply.text}")
        data = reply.json()
        return data if isinstance(data, dict) else {}

    def connect(self, model: Any) -> None:
        """Set up the group with the server (idempotent); the server checks the layout first."""
        if self._group is not None:
            return
        backend = self.backend or _default_backend(model)
        ranks = int(self.status().get("ranks", 1))
        world_size = 1 + ranks
        store = weight_store(self.host, 0, world_size=world_size, is_host=True, timeout_s=self.timeout_s)
        specs = [s for b in plan_buckets(named_weights(model), self.bucket_bytes) for s in b.specs]
        # the server joins in the background once the layout is checked (202); rank 0 joins here
        self._post(
            "/weights/init_group",
            {
                "host": self.host,
                "port": int(store.port),
                "rank_offset": 1,
                "world_size": world_size,
                "backend": backend,
                "timeout_s": self.timeout_s,
                "tensors": [s.to_json() for s in specs],
            },
        )
        self._group = self._join(store, world_size, backend)
        self._store = store
        logger.info("weight group with %s ready (%s, %d ranks)", self.url, backend, world_size)

    def _join(self, store: Any, world_size: int, backend: Backend) -> WeightGroup:
        """Join as rank 0 while watching the server: a server that fails to join is reported at once
        (its ``/weights/status`` error), not after ``timeout_s`` of waiting for it."""
        outcome: dict[str, Any] = {}

        def build() -> None:
            try:
                outcome["group"] = open_weight_group(
                    store, rank=0, world_size=world_size, backend=backend, timeout_s=self.timeout_s
                )
            except BaseException as exc:  # handed to the caller below
                outcome["error"] = exc

        thread = threading.Thread(target=build, name="gymbridge-weight-group", daemon=True)
        thread.start()
        while True:
            thread.join(0.25)
            if not thread.is_alive():
                break
            error = self.status().get("error")
            if error:
                raise WeightSyncError(f"the server at {self.url} could not join the weight group: {error}")
        if "error" in outcome:
            raise outcome["error"]
        group: WeightGroup = outcome["group"]
        return group

    # ------------------------------------------------------------------ publishing

    def publish(self, model: Any, version: int) -> float:
        started = time.perf_counter()
        if self.version is not None and version < self.version:
            raise WeightSyncError(f"policy version {version} is older than the published {self.version}")
        self.connect(model)
        assert self._group is not None
        named = named_weights(model)
        buckets = plan_buckets(named, self.bucket_bytes)
        self._post("/weights/update", {"version": version, "buckets": [b.to_json() for b in buckets]})
        tensors = dict(named)
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        with torch.no_grad():
            for bucket in buckets:
                flat = bucket_tensors(bucket, [tensors[s.name] for s in bucket.specs], device)
                self._group.broadcast(flat, timeout_s=self.timeout_s)
                del flat  # one bucket at a time: the weights never exist twice here
        self._wait_loaded(version)
        self.version = version
        self.syncs += 1
        self.last_sync_s = time.perf_counter() - started
        return self.last_sync_s

    def _wait_loaded(self, version: int) -> None:
        key = loaded_key(version)
        try:
            self._store.wait([key])
            mark = bytes(self._store.get(key)).decode()
        except RuntimeError as exc:
            raise WeightSyncError(f"the server did not confirm policy version {version}: {exc}") from exc
        if mark != "ok":
            raise WeightSyncError(f"the server failed to load policy version {version}: {mark}")

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
        self._store = None
        self._http.close()
