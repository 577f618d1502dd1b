"""A generator fleet: ``generator.replicas: N`` model servers behind the run's own router.

A real run trains on-policy with 2 replicas (shared memory and broadcast); a replica killed with
``kill -9`` in the middle of a generation is restarted, re-synced and serves again while the run
completes every step on-policy; both killed stop the run with a typed error naming the floor.
"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from run_helpers import run_config

from gymbridge.errors import ConfigError, GeneratorFleetError
from gymbridge.run import load_run_config, train
from gymbridge.run.callbacks import Callback, default_callbacks
from gymbridge.run.fleet import replica_devices

SMALL = {
    "bridge.prompts_per_step": 2,
    "bridge.group_size": 4,
    "rollout.max_tokens": 16,
    "warmup.steps": 0,
    "shaping.kind": "token_rate",  # the random model's groups have reward variance: every step trains
    "generator.placement": "process",
    "generator.replicas": 2,
    "generator.restart_backoff_s": 0.2,
    "trainer.ratio_tolerance": 0.01,
}


def gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


class Fleet(Callback):
    """Watches the run's fleet; ``kill`` replicas with SIGKILL while they have calls in flight."""

    def __init__(
        self,
        kill: tuple[int, ...] = (),
        after_step: int = 1,
        wait_back_at: int | None = None,
        back: tuple[str, ...] = ("HEALTHY",),
    ):
        self.kill = kill
        self.back = back
        """States that count as back (a broadcast replica is STALE until the next publication)."""
        self.after_step = after_step
        self.wait_back_at = wait_back_at
        self.fleet: Any = None
        self.pids: set[int] = set()
        self.segments: list[str] = []
        self.killed: list[int] = []
        self.in_flight_at_kill: list[int] = []
        self.back_after_s: float | None = None

    def on_setup(self, run: Any) -> None:
        handle = run.services.generator
        self.fleet = handle.fleet
        writer = getattr(handle.publisher, "_writer", None)
        self.segments = list(writer.names) if writer is not None else []

    def on_step(self, report: Any, record: Any) -> None:
        self.pids.update(p for p in self.fleet.pids if p is not None)
        if report.step == self.after_step and self.kill:
            threading.Thread(target=self._kill, daemon=True).start()
        if report.step == self.wait_back_at:
            started = time.monotonic()
            replica = self.fleet.router.replicas[self.kill[0]]
            while time.monotonic() - started < 120 and not (
                replica.restarts and replica.state.value in self.back
            ):
                time.sleep(0.05)
            self.back_after_s = time.monotonic() - started

    def _kill(self) -> None:
        replicas = self.fleet.router.replicas
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(replicas[i].in_flight for i in self.kill):
            time.sleep(0.002)
        self.in_flight_at_kill = [replicas[i].in_flight for i in self.kill]
        for i in self.kill:
            pid = self.fleet.children[i].pid
            os.killpg(pid, signal.SIGKILL)
            self.killed.append(pid)


def fleet_train(tmp_path: Path, settings: dict[str, Any], watcher: Fleet) -> tuple[Any, str]:
    out = io.StringIO()
    callbacks = [*default_callbacks(out=out, artifacts=False), watcher]
    summary = train(run_config(tmp_path, settings), out=out, callbacks=callbacks)
    return summary, out.getvalue()


def records(tmp_path: Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / name).read_text().splitlines() if line.strip()]


def assert_on_policy(steps: list[dict[str, Any]]) -> None:
    trained = [r for r in steps if r.get("skipped") is None]
    assert trained, "no step trained"
    assert all(abs(r["ratio_mean"] - 1.0) < 1e-3 for r in trained), [r["ratio_mean"] for r in trained]


def assert_every_rollout_accounted(tmp_path: Path, summary: Any, group_size: int) -> None:
    stats = summary.bridge_stats
    failed = [r for r in records(tmp_path, "failures.jsonl") if r.get("kind") == "rollout"]
    assert stats["prompts_started"] * group_size == (
        stats["rollouts_ok"] + stats["rollouts_failed"] + stats["rollouts_cancelled"]
    ), stats
    assert len(failed) == stats["rollouts_failed"] + stats["rollouts_cancelled"], stats


@pytest.mark.integration
@pytest.mark.parametrize(
    ("transport", "line"), [("shared_memory", "shared memory"), ("broadcast", "torch.distributed broadcast")]
)
def test_two_replicas_train_on_policy_and_share_the_calls(transport: str, line: str, tmp_path: Path) -> None:
    watcher = Fleet()
    summary, text = fleet_train(
        tmp_path, {**SMALL, "steps": 3, "generator.weight_transport": transport}, watcher
    )
    steps = records(tmp_path)
    assert len(steps) == 3 and summary.rollouts_failed == 0
    assert_on_policy(steps)
    assert "fleet of 2 model servers" in text and f"weights published after every step ({line}" in text
    for r in steps:
        assert r["generator/fleet/healthy"] == 2
        for i in (0, 1):  # every replica served every step, at the run's version
            assert r[f"generator/replica_{i}/requests"] > 0 and r[f"generator/replica_{i}/state"] == "HEALTHY"
            assert r[f"generator/replica_{i}/policy_version"] == r["policy_version"]
            sync = r[f"generator/replica_{i}/sync_s"]
            assert 0 < sync <= r["weight_sync_s"]  # wallclock-ok: the step's sync is its slowest replica's
    assert {p.name for p in tmp_path.glob("model_server_*.log")} == {
        "model_server_0.log",
        "model_server_1.log",
    }
    assert watcher.pids and all(gone(p) for p in watcher.pids)
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in watcher.segments)


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["shared_memory", "broadcast"])
def test_a_replica_killed_mid_generation_is_restarted_resynced_and_serves_again(
    transport: str, tmp_path: Path
) -> None:
    """kill -9 of replica 0 while it has calls in flight: they go to replica 1, the run completes every
    step on-policy, replica 0 comes back (shared memory: re-synced from the segment at once; broadcast:
    at the next publication) and serves calls again at the run's version."""
    back = ("HEALTHY",) if transport == "shared_memory" else ("STALE", "HEALTHY")  # joins at the next step
    watcher = Fleet(kill=(0,), after_step=1, wait_back_at=3, back=back)
    settings = {**SMALL, "steps": 6, "generator.weight_transport": transport}
    summary, _ = fleet_train(tmp_path, settings, watcher)
    steps = records(tmp_path)
    assert len(steps) == 6 and watcher.killed and watcher.in_flight_at_kill[0] > 0
    assert watcher.back_after_s is not None  # it served again (how soon: benchmarks/fleet.py)
    assert_on_policy(steps)
    assert_every_rollout_accounted(tmp_path, summary, group_size=4)
    restarted = [r["step"] for r in steps if r["generator/replica_0/restarts"]]
    assert len(restarted) == 1, restarted
    after = [r for r in steps if r["step"] > restarted[0]]
    assert after and all(r["generator/replica_0/state"] == "HEALTHY" for r in after)
    assert all(r["generator/replica_0/policy_version"] == r["policy_version"] for r in after)
    assert sum(r["generator/replica_0/requests"] for r in after) > 0  # it serves again
    lost = sum(r["generator/replica_0/errors"] for r in steps)
    assert lost >= 1 and sum(r["generator/replica_0/retried"] for r in steps) >= 1
    log = (tmp_path / "model_server_0.log").read_text()
    assert log.count("--- model server start") == 2  # the first process and its replacement
    assert all(gone(p) for p in watcher.pids) and len(watcher.pids) == 3


@pytest.mark.integration
def test_both_replicas_killed_stop_the_run_with_an_error_naming_the_floor(tmp_path: Path) -> None:
    watcher = Fleet(kill=(0, 1), after_step=1)
    with pytest.raises(GeneratorFleetError, match=r"below generator\.min_healthy=1") as info:
        fleet_train(tmp_path, {**SMALL, "steps": 6}, watcher)
    assert info.value.healthy == 0 and info.value.min_healthy == 1 and info.value.replicas == 2
    assert len(watcher.killed) == 2
    steps = records(tmp_path)
    assert 1 <= len(steps) < 6
    failed = [r for r in records(tmp_path, "failures.jsonl") if r.get("kind") == "rollout"]
    assert failed and {r["failure_class"] for r in failed} <= {
        "generator_lost",
        "GeneratorFleetError",
        "cancelled",
    }
    assert all(gone(p) for p in watcher.pids)


def test_replicas_need_process_placement() -> None:
    with pytest.raises(ConfigError, match=r"needs generator\.placement=process"):
        load_run_config(["smoke"], [("generator.replicas", 2)])
    with pytest.raises(ConfigError, match=r"min_healthy=3 is more than generator\.replicas=2"):
        load_run_config(
            ["smoke"],
            [("generator.placement", "process"), ("generator.replicas", 2), ("generator.min_healthy", 3)],
        )


def test_vllm_engine_arguments_need_the_vllm_backend(tmp_path: Path) -> None:
    settings = {**SMALL, "steps": 1, "generator.tensor_parallel_size": 2, "generator.max_num_seqs": 8}
    with pytest.raises(ConfigError, match="tensor_parallel_size, max_num_seqs: vLLM engine arguments"):
        train(run_config(tmp_path, settings), out=io.StringIO())


def test_the_model_server_refuses_vllm_engine_flags_on_hf() -> None:
    import argparse

    from gymbridge.generation.cli import add_model_commands, build_generator

    parser = argparse.ArgumentParser()
    add_model_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--tiny", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.5"])
    with pytest.raises(ConfigError, match="--gpu-memory-utilization, --dtype: vLLM engine arguments"):
        build_generator(args)


def test_replica_devices() -> None:
    # no GPU, no rule: the environment is left alone
    assert replica_devices(2, devices_per_replica=None, visible=[]) == [None, None]
    # GPUs visible: for vLLM tensor_parallel_size each (1 by default), in order
    assert replica_devices(2, devices_per_replica=None, visible=["0", "1", "2", "3"]) == ["0", "1"]
    # a transformers model server: the environment left alone unless asked
    assert replica_devices(2, devices_per_replica=None, vllm=False, visible=["0"]) == [None, None]
    assert replica_devices(2, devices_per_replica=1, vllm=False, visible=["0", "1"]) == ["0", "1"]
    four = ["0", "1", "2", "3"]
    assert replica_devices(2, devices_per_replica=None, tensor_parallel_size=2, visible=four) == [
        "0,1",
        "2,3",
    ]
    assert replica_devices(2, devices_per_replica=1, devices=[3, 5]) == ["3", "5"]
    assert replica_devices(3, devices_per_replica=0, visible=["0"]) == [None, None, None]
    with pytest.raises(ConfigError, match="needs 4 GPU"):
        replica_devices(2, devices_per_replica=2, visible=["0", "1", "2"])


def test_the_fleet_errors_in_the_tree() -> None:
    from gymbridge import errors as E

    lost = E.GeneratorLostError("x", status=503)
    assert isinstance(lost, E.EnvServerError) and not lost.retryable  # the router already retried
    assert lost.failure_class == "generator_lost" and lost.header == E.EnvSessionLostError.header
    floor = E.GeneratorFleetError("below", healthy=0, min_healthy=1, replicas=2)
    assert isinstance(floor, E.GeneratorProcessError) and isinstance(floor, E.TrainingError)
    assert (floor.healthy, floor.min_healthy, floor.replicas) == (0, 1, 2)
    assert all(c.__name__ in (E.__doc__ or "") for c in (E.GeneratorLostError, E.GeneratorFleetError))


def test_regression_replicas_do_not_share_a_prompt_seed() -> None:
    """Each replica seeds its per-prompt samples differently: one seed for all would give a group whose
    G rollouts split over two replicas identical pairs of samples."""
    from gymbridge.run.fleet import replica_commands

    command = ["gymbridge", "model", "serve", "--tiny", "--prompt-seed", "7", "--port", "0"]
    made = replica_commands(command, 3)
    seeds = [c[c.index("--prompt-seed") + 1] for c in made]
    assert seeds[0] == "7" and len(set(seeds)) == 3
    assert all(c[:5] == command[:5] and c[6:] == command[6:] for c in made)
    assert replica_commands(["serve", "--tiny"], 2) == [["serve", "--tiny"]] * 2  # nothing to vary
