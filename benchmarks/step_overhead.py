"""What the bridge costs per step and per rollout (issue 29): a scripted mode and a smoke mode.

``--scripted``: the bridge's own CPU per rollout with model compute at zero. This process runs
what the default smoke runs in its process, minus the model: the ``color_pick`` environment
server, gymbridge's ``SimpleAgent``, the ``GymClient``, ``GymRollouts`` and the
``BridgeIterator`` (postprocessing, the real tiny Qwen2-VL ``MediaProcessor``, dedup, group
advantages), all on one event loop. The model is a ``ScriptedModelServer`` in a child process
(its CPU is reported apart): each rollout calls the ``look`` tool ``turns - 1`` times (a new
56x56 image each time) and then answers, so a rollout of ``turns`` turns makes ``turns`` model
calls and ``turns - 1`` tool calls, with one image per turn. For each G (rollouts per prompt,
2 prompts per step as in the smoke) and each turn count it runs ``--warmup`` steps, then
``--steps`` steps, and prints this process's CPU seconds per rollout (``time.process_time``:
every thread), the wall time per step, and the split the components report (each batch's
``BridgeBatch.timings``, the agent's counters). Goal: at most 5 ms per one-turn rollout, linear
in turns.

Default (no ``--scripted``): ``gymbridge smoke run`` of the default config for ``--steps``
steps in a child process (``--set`` passes more overrides), then the per-step split read from
its ``metrics.jsonl``: every timing key a record holds (``step_s``, the ``timing/*`` phases,
``weight_sync_s``, the trainer's ``elapsed_s``, ``forward_backward_s``, ``optimizer_s``),
median over the steps after the first, and the bridge's own share (``step_s`` less generation,
forward/backward and the optimizer). ``--artifacts both`` repeats the run with
``output.artifacts=false``.

    .venv/bin/python benchmarks/step_overhead.py --scripted [--groups 8 16 64] [--turns 1 2 4]
    .venv/bin/python benchmarks/step_overhead.py --steps 20 [--artifacts both]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

MODEL = """
import json, logging, sys
import gymbridge.testing.scripted_model as sm
from gymbridge.server import serve
from gymbridge.testing.scripted_model import ScriptedModelServer

logging.basicConfig(level=logging.WARNING)
# the tiny Qwen2-VL's ids: <|im_start|> 1, <|vision_start|> 3, <|vision_end|> 4, <|image_pad|> 5;
# text words hash into 20..499; a 56x56 image is 4 image tokens after the 2x2 merge
sm.ASSISTANT_START_TOKEN = 19  # the double's default (3) is <|vision_start|> in this vocabulary


def word(w):
    return 20 + sum(w.encode()) * 2654435761 % 480


def tokenize(items):
    ids = []
    for item in items:
        ids.append(1)
        content = item.get("content", item.get("output")) if isinstance(item, dict) else str(item)
        parts = content if isinstance(content, list) else [{"text": str(content or "")}]
        for part in parts:
            if isinstance(part, dict) and part.get("type") in ("input_image", "image_url"):
                ids += [3, 5, 5, 5, 5, 4]
            elif isinstance(part, dict):
                ids += [word(w) for w in str(part.get("text", "")).split()] or [21]
    return ids


turns = int(sys.argv[2])
script = [{"calls": [{"name": "look", "arguments": {}}]}] * (turns - 1) + ["red"]
serve(ScriptedModelServer(script, tokenize=tokenize, keep_requests=False), port=int(sys.argv[1]))
"""


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the scripted model exited with {proc.returncode}")
        try:
            if httpx.get(url + "/", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}: not ready after {timeout_s:.0f} s")


def _rows(n: int, turns: int) -> list[dict[str, Any]]:
    from gymbridge_envs.color_pick.data import make_row, tools

    rows = []
    for i in range(n):
        row = make_row(0, i, reveal="prompt")
        rcp = {**row["responses_create_params"], "max_output_tokens": 4, "temperature": 1.0}
        if turns > 1:
            rcp["tools"] = tools()
        rows.append({**row, "responses_create_params": rcp})
    return rows


async def _scripted_level(model_url: str, g: int, turns: int, warmup: int, steps: int) -> dict[str, Any]:
    from gymbridge.bridge import BridgeConfig, BridgeIterator, GymRollouts
    from gymbridge.client import GymClient
    from gymbridge.models.tiny_vlm import build_tiny_vlm
    from gymbridge.server import SimpleAgent, start_server
    from gymbridge.tensors import MediaProcessor
    from gymbridge_envs.color_pick.server import ColorPickServer

    tiny = build_tiny_vlm(0)
    prompts = 2
    env = await start_server(ColorPickServer(max_looks=max(turns, 1)))
    agent = SimpleAgent(resources_url=env.url, model_url=model_url, max_steps=turns)
    running = await start_server(agent)
    client = GymClient(running.url, deadline_s=300)
    try:
        bridge = BridgeIterator(
            _rows(prompts * (warmup + steps), turns),
            GymRollouts(client, deadline_s=300),
            MediaProcessor(tiny.processor),
            BridgeConfig(group_size=g, prompts_per_step=prompts, min_group_size=g),
            placeholder_token_ids=[tiny.image_token_id, tiny.video_token_id],
        )
        for _ in range(warmup):
            await bridge.next_batch()
        agent_before = agent.counters()
        ok_before = bridge.stats.rollouts_ok
        cpu0, wall0 = time.process_time(), time.perf_counter()
        split: dict[str, float] = {}
        for _ in range(steps):
            got = await bridge.next_batch()
            for k, v in got.timings.as_dict().items():
                split[k] = split.get(k, 0.0) + v
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        rollouts = bridge.stats.rollouts_ok - ok_before
        agent_delta = {k: v - agent_before.get(k, 0.0) for k, v in agent.counters().items()}
        failed = bridge.stats.rollouts_failed
        await bridge.aclose()
    finally:
        await client.aclose()
        await running.stop()
        await env.stop()
    return {
        "g": g,
        "turns": turns,
        "rollouts": rollouts,
        "failed": failed,
        "cpu_ms_per_rollout": 1000 * cpu / max(rollouts, 1),
        "wall_s_per_step": wall / steps,
        "postprocess_ms_per_rollout": 1000 * split.get("postprocess_s", 0.0) / max(rollouts, 1),
        "build_ms_per_rollout": 1000
        * (split.get("build_s", 0.0) + split.get("assemble_s", 0.0))
        / max(rollouts, 1),
        "agent_env_ms_per_rollout": 1000
        * sum(
            v
            for k, v in agent_delta.items()
            if k.startswith("env_") and k.endswith("_s") and "_busy" not in k
        )
        / max(rollouts, 1),
        "agent_model_ms_per_rollout": 1000 * agent_delta.get("model_s", 0.0) / max(rollouts, 1),
    }


def scripted(groups: list[int], turn_counts: list[int], warmup: int, steps: int) -> list[dict[str, Any]]:
    rows = []
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(REPO)}
    for turns in turn_counts:
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, "-c", MODEL, str(port), str(turns)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_http(url, proc)
            for g in groups:
                model_cpu0 = _cpu_s(proc.pid)
                row = asyncio.run(_scripted_level(url, g, turns, warmup, steps))
                row["model_cpu_ms_per_rollout"] = (
                    1000 * (_cpu_s(proc.pid) - model_cpu0) / max(row["rollouts"], 1)
                )
                rows.append(row)
                print(
                    f"G={g:<3} turns={turns}  bridge CPU {row['cpu_ms_per_rollout']:6.2f} ms/rollout  "
                    f"(postprocess {row['postprocess_ms_per_rollout']:.2f}, "
                    f"build {row['build_ms_per_rollout']:.2f})  "
                    f"wall {row['wall_s_per_step']:.3f} s/step  failed {row['failed']}",
                    flush=True,
                )
        finally:
            proc.terminate()
            proc.wait(30)
    return rows


def print_scripted(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| G | turns | rollouts | bridge CPU ms/rollout | per turn | postprocess ms | build ms "
        "| agent env ms (wall, summed) | agent model ms (wall, summed) | scripted model CPU ms "
        "| wall s/step |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['g']} | {r['turns']} | {r['rollouts']} | {r['cpu_ms_per_rollout']:.2f} | "
            f"{r['cpu_ms_per_rollout'] / r['turns']:.2f} | {r['postprocess_ms_per_rollout']:.2f} | "
            f"{r['build_ms_per_rollout']:.2f} | {r['agent_env_ms_per_rollout']:.2f} | "
            f"{r['agent_model_ms_per_rollout']:.2f} | {r['model_cpu_ms_per_rollout']:.2f} | "
            f"{r['wall_s_per_step']:.3f} |"
        )


# ---------------------------------------------------------------------------- smoke mode


def smoke(steps: int, overrides: list[str], artifacts: bool) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [
            str(Path(sys.executable).parent / "gymbridge"),
            "--log-level",
            "WARNING",
            "smoke",
            "run",
            "--steps",
            str(steps),
            "--no-progress",
            "--set",
            f"output.run_dir={run_dir}",
        ]
        for item in overrides:
            cmd += ["--set", item]
        if not artifacts:
            cmd += ["--set", "output.artifacts=false"]
        started = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        took = time.perf_counter() - started
        print(f"smoke run ({'with' if artifacts else 'without'} artifacts): {took:.1f} s")
        metrics = run_dir / "metrics.jsonl"
        return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _timing_keys(records: list[dict[str, Any]]) -> list[str]:
    keys: list[str] = []
    for rec in records:
        for k, v in _flatten(rec).items():
            timed = k.endswith("_s") or "timing" in k
            if timed and isinstance(v, (int, float)) and not isinstance(v, bool) and k not in keys:
                keys.append(k)
    return keys


def _flatten(rec: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in rec.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def print_smoke(runs: dict[str, list[dict[str, Any]]]) -> None:
    keys = _timing_keys([r for records in runs.values() for r in records])
    names = list(runs)
    print("\nmedian per step over steps 2..N (seconds; every timing key metrics.jsonl holds):\n")
    print("| key | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for key in keys:
        cells = []
        for name in names:
            values = [_flatten(r).get(key) for r in runs[name][1:]]
            values = [v for v in values if isinstance(v, (int, float))]
            cells.append(f"{statistics.median(values):.4f}" if values else "-")
        print(f"| {key} | " + " | ".join(cells) + " |")
    print("\nthe bridge's own seconds per step (step_s less generation, forward_backward, optimizer):")
    for name in names:
        own = [_bridge_own(r) for r in runs[name][1:]]
        steps = [float(r["step_s"]) for r in runs[name][1:]]
        if own:
            print(
                f"  {name}: median {statistics.median(own):.4f} s of a median step of "
                f"{statistics.median(steps):.4f} s"
            )


def _bridge_own(rec: dict[str, Any]) -> float:
    model = sum(float(rec.get(f"timing/{k}", 0.0)) for k in ("generation", "forward_backward", "optimizer"))
    return float(rec["step_s"]) - model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scripted", action="store_true", help="bridge CPU per rollout, scripted model")
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 16, 64], help="G values (--scripted)")
    parser.add_argument(
        "--turns", type=int, nargs="+", default=[1, 2, 4], help="turns per rollout (--scripted)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="steps before measuring (--scripted)")
    parser.add_argument("--steps", type=int, default=0, help="measured steps (default: 8 scripted, 20 smoke)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="smoke config override")
    parser.add_argument(
        "--artifacts", choices=["on", "both"], default="on", help="smoke: also run without them"
    )
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    if args.scripted:
        rows = scripted(args.groups, args.turns, args.warmup, args.steps or 8)
        print_scripted(rows)
        result: Any = rows
    else:
        steps = args.steps or 20
        runs = {"artifacts on": smoke(steps, args.overrides, True)}
        if args.artifacts == "both":
            runs["artifacts off"] = smoke(steps, args.overrides, False)
        print_smoke(runs)
        result = runs
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
