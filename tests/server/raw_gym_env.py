"""A raw (not SDK-built) gymnasium environment for tests of the shared step handling.

Role: answers ``/reset`` and ``/step`` with bodies the SDK would never produce, so the tests can
show that both rollout loops (``SimpleAgent`` and ``run_episode``) turn a ``/step`` answer into the
same items and refuse the same malformed answers. The row's ``bad`` key picks a malformation of
the first ``/step`` answer; without it, step k answers one tool output ``call_k`` / ``ran k`` and
the observation ``obs k``, and step 3 terminates with reward 1.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

BAD_STEPS: dict[str, dict[str, Any]] = {
    "reward_is_bool": {"reward": True},
    "reward_is_nan_string": {"reward": "NaN"},
    "terminated_is_string": {"terminated": "yes"},
    "info_is_list": {"info": ["tool_outputs"]},
    "tool_outputs_not_a_list": {"info": {"tool_outputs": {"call_id": "c", "output": "x"}}},
    "tool_output_without_call_id": {"info": {"tool_outputs": [{"output": "x"}]}},
    "tool_output_not_an_object": {"info": {"tool_outputs": ["x"]}},
}
"""Malformed first ``/step`` answers, by name (each a patch over a valid answer)."""


ROW = {"responses_create_params": {"input": "play"}, "episode": "e"}
EXPECTED_ENV_ITEMS = [
    {"type": "function_call_output", "call_id": "call_1", "output": "ran 1"},
    {"type": "message", "role": "user", "content": "obs 1"},
    {"type": "function_call_output", "call_id": "call_2", "output": "ran 2"},
    {"type": "message", "role": "user", "content": "obs 2"},
]
"""The environment's items of a valid 3-step episode: the terminating step adds none."""


def step_answer(k: int) -> dict[str, Any]:
    """The valid answer to step ``k`` (1-based)."""
    return {
        "observation": f"obs {k}",
        "reward": 1.0 if k == 3 else 0.0,
        "terminated": k == 3,
        "truncated": False,
        "info": {"tool_outputs": [{"call_id": f"call_{k}", "output": f"ran {k}"}]},
    }


def raw_gym_app() -> web.Application:
    """The environment as an aiohttp app (``start_server`` accepts it)."""
    steps: dict[str, int] = {}

    async def reset(request: web.Request) -> web.Response:
        row = await request.json()
        episode = str(row.get("episode", "e"))
        steps[episode] = 0
        return web.json_response({"observation": "start", "info": {"supports_explicit_close": False}})

    async def step(request: web.Request) -> web.Response:
        body = await request.json()
        episode = str(body.get("episode", "e"))
        steps[episode] = steps.get(episode, 0) + 1
        answer = step_answer(steps[episode])
        bad = body.get("bad")
        if bad is not None:
            answer.update(BAD_STEPS[bad])
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/reset", reset)
    app.router.add_post("/step", step)
    return app


def env_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The environment's items of a rollout's output (tool outputs and observations), in order."""
    return [o for o in output if o.get("type") == "function_call_output" or o.get("role") == "user"]
