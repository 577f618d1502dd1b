"""Genuine ``simple_agent`` (nemo-gym 0.7.0) runs rows with media references against our model server.

A reference is an ordinary ``http`` image URL on gymbridge's media server
(``<base>/media/<content key>``), so a genuine agent passes it through untouched. Our model
server (the tiny Qwen2-VL, greedy) fetches it once per server (a listed media host, the bytes
verified against the key) and answers exactly the tokens it answers for the same image inline.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _genuine import KIND_AGENTS, KIND_MODELS, KIND_RESOURCES, GenuineStack, ref
from _gym_support import ThreadedLoop

from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.server import ModelServer, ModelServerConfig
from gymbridge.media import MediaPolicy
from gymbridge.media.refs import DataRef, decode_data_payload, parse_ref
from gymbridge.media.store import MediaServer, MediaStore, parse_media_ref
from gymbridge.server import start_server
from gymbridge_envs.circle_click.data import generate as circle_click_rows
from gymbridge_envs.circle_click.server import CircleClickServer

pytestmark = pytest.mark.gym

GROUP = 4
TOKEN_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def _image_parts(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        part
        for item in row["responses_create_params"]["input"]
        if isinstance(item.get("content"), list)
        for part in item["content"]
        if part.get("type") == "input_image"
    ]


def _by_reference(row: dict[str, Any], media: MediaServer) -> dict[str, Any]:
    out = copy.deepcopy(row)
    for part in _image_parts(out):
        data = parse_ref(part["image_url"])
        assert isinstance(data, DataRef)
        part["image_url"] = media.url_for(
            media.store.put(decode_data_payload(data, max_bytes=1 << 26, source="t"))
        )
    return out


@pytest.fixture(scope="module")
def stack(
    fixture_loop: ThreadedLoop,
    tiny_gen: HFGenerator,
    gym_log_root: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[GenuineStack, MediaServer, ModelServer]]:
    media = MediaServer(MediaStore(tmp_path_factory.mktemp("media")))
    media.start()
    model = ModelServer(
        tiny_gen,
        config=ModelServerConfig(model_name="tiny", max_model_len=4096, default_max_tokens=8),
        media_policy=MediaPolicy(media_hosts=(media.host_entry,)),
    )
    fixture_loop.run(model.start())
    env = fixture_loop.run(start_server(CircleClickServer(instance_name="ours_circle_click_refs")))
    genuine = GenuineStack(gym_log_root / "genuine_agent_refs")
    genuine.add(
        "ours_policy", KIND_MODELS, "vllm_model", port=int(str(model.url).rsplit(":", 1)[1]), launch=False
    )
    genuine.add("ours_circle_click_refs", KIND_RESOURCES, "circle_click", port=env.port, launch=False)
    genuine.add(
        "agent_refs",
        KIND_AGENTS,
        "simple_agent",
        resources_server=ref(KIND_RESOURCES, "ours_circle_click_refs"),
        model_server=ref(KIND_MODELS, "ours_policy"),
        max_steps=2,
    )
    try:
        genuine.start()
        yield genuine, media, model
    finally:
        genuine.stop()
        fixture_loop.run(env.stop())
        fixture_loop.run(model.stop())
        media.stop()


def _run_all(stack: GenuineStack, rows: list[dict[str, Any]]) -> list[httpx.Response]:
    def one(row: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{stack.url('agent_refs')}/run", json=row, timeout=120, trust_env=False)

    with cf.ThreadPoolExecutor(len(rows)) as pool:
        return list(pool.map(one, rows))


def _token_fields(result: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        tuple(o.get(k) for k in TOKEN_KEYS)
        for o in result["response"]["output"]
        if "generation_token_ids" in o
    ]


def test_genuine_simple_agent_runs_a_group_of_referenced_rows_on_our_model_server(
    stack: tuple[GenuineStack, MediaServer, ModelServer],
) -> None:
    genuine, media, model = stack
    row = next(iter(circle_click_rows(1, seed=21)))
    row["responses_create_params"] = {
        **row["responses_create_params"],
        "temperature": 0.0,
        "max_output_tokens": 8,
    }
    referenced = _by_reference(row, media)
    urls = [p["image_url"] for p in _image_parts(referenced)]
    assert urls and all(parse_media_ref(u) for u in urls)
    before = model.media_cache.stats()["kinds"].get("fetched:image", {"misses": 0, "hits": 0})
    served = media.requests_served

    group = _run_all(genuine, [referenced] * GROUP)
    assert [r.status_code for r in group] == [200] * GROUP, [r.text[:500] for r in group]
    results = [r.json() for r in group]
    for result in results:
        # the genuine agent kept the references: the echoed row still holds them
        assert [p["image_url"] for p in _image_parts(result)] == urls
        assert _token_fields(result)
    # the group's image was fetched from the store once by our model server
    assert media.requests_served - served == len(set(urls))
    after = model.media_cache.stats()["kinds"]["fetched:image"]
    assert after["misses"] - before["misses"] == len(set(urls))
    # greedy: the same tokens and logprobs as the inline row
    (inline,) = _run_all(genuine, [row])
    assert inline.status_code == 200, inline.text[:500]
    # (tokens exactly; logprobs to float32 noise: the group's requests were batched together)
    want = _token_fields(inline.json())
    for result in results:
        got = _token_fields(result)
        assert [(p, g) for p, g, _ in got] == [(p, g) for p, g, _ in want]
        for (_, _, a), (_, _, b) in zip(got, want, strict=True):
            assert a == pytest.approx(b, abs=1e-5)
