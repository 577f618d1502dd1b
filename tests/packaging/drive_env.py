"""Run inside a venv built from the base install (no torch): serve, check and drive an environment.

Usage: ``python drive_env.py ENV``. Starts ``gymbridge env serve ENV --port 0`` as a process
(reading the URL from its one ``serving ... on URL`` line), runs ``check_env`` against it, then
drives one rollout per row through gymbridge's agent and a scripted model server (no model, no
torch) and checks that every rollout solves its row. Prints one JSON line with what it saw;
exit code 0 only when everything passed and torch was never imported.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

from gymbridge.server import SimpleAgent, check_env, start_server
from gymbridge.testing.scripted_model import ScriptedModelServer
from gymbridge_envs import get_env
from gymbridge_envs._testing import oracle_script

URL_LINE = re.compile(r"serving \S+ on (http://\S+)")


def start_env_process(env: str) -> tuple[subprocess.Popen[str], str]:
    gymbridge = Path(sys.executable).with_name("gymbridge")
    proc = subprocess.Popen(
        [str(gymbridge), "env", "serve", env, "--port", "0"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        match = URL_LINE.search(line)
        if match:
            return proc, match.group(1)
    raise SystemExit(f"env serve exited ({proc.wait()}) without announcing a URL")


async def drive(env: str, url: str) -> dict[str, object]:
    spec = get_env(env)
    rows = list(spec.generate(3, seed=0))
    report = await check_env(url, rows, generate=lambda seed: list(spec.generate(3, seed=seed)))
    rewards: list[float] = []
    for row in rows:
        model = ScriptedModelServer(oracle_script(env, row))
        model_url = await model.start()
        agent = SimpleAgent(resources_url=url, model_url=model_url)
        try:
            async with await start_server(agent) as running, httpx.AsyncClient(timeout=30) as client:
                reply = await client.post(f"{running.url}/run", json=row)
                reply.raise_for_status()
                rewards.append(float(reply.json()["reward"]))
        finally:
            await model.stop()
    return {"check_env_ok": report.ok, "rewards": rewards}


def main() -> int:
    env = sys.argv[1]
    proc, url = start_env_process(env)
    try:
        seen = asyncio.run(drive(env, url))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    seen["torch_imported"] = "torch" in sys.modules
    seen["transformers_imported"] = "transformers" in sys.modules
    seen["python"] = sys.executable
    seen["cwd"] = os.getcwd()
    print(json.dumps(seen))
    rewards = seen["rewards"]
    solved = isinstance(rewards, list) and bool(rewards) and all(r == 1.0 for r in rewards)
    return 0 if seen["check_env_ok"] and solved and not seen["torch_imported"] else 1


if __name__ == "__main__":
    sys.exit(main())
