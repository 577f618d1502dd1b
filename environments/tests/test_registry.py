"""Every registered environment: row shape, determinism, media validity, tools == server's tools."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from gymbridge.errors import ConfigError
from gymbridge.media import MediaItem
from gymbridge.protocol import parse_run_request
from gymbridge.server import ResourcesServer
from gymbridge_envs import ENVIRONMENTS, get_env, list_envs

NAMES = sorted(ENVIRONMENTS)
ROOT = Path(__file__).resolve().parents[1]
ALLOWED_PARAMS_KEYS = {"input", "tools", "metadata"}


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict[str, Any]]]:
    return {name: list(get_env(name).generate(3, seed=11)) for name in NAMES}


def test_registry_lists_each_environment_folder_once() -> None:
    folders = sorted(p.parent.name for p in ROOT.glob("*/server.py"))
    assert folders == NAMES == sorted(spec.name for spec in list_envs())
    for name in NAMES:
        assert (ROOT / name / "README.md").is_file(), f"{name} has no README"


def test_unknown_environment_and_unknown_parameter_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown environment 'nope'"):
        get_env("nope")
    with pytest.raises(ConfigError, match=r"unknown generator parameter 'colour'.*img_size"):
        list(get_env("circle_click").generate(1, colour="red"))


@pytest.mark.parametrize("name", NAMES)
def test_server_class_matches_declared_style(name: str) -> None:
    spec = get_env(name)
    cls = spec.server_class()
    assert issubclass(cls, ResourcesServer)
    assert spec.make_server().is_gymnasium == (spec.style == "gymnasium")


@pytest.mark.parametrize("name", NAMES)
def test_rows_are_stock_gym_rows(name: str, rows: dict[str, list[dict[str, Any]]]) -> None:
    for row in rows[name]:
        params = row["responses_create_params"]
        # 0.7.0 forbids extra keys inside responses_create_params: task data rides at the top level.
        assert set(params) <= ALLOWED_PARAMS_KEYS
        # every prompt opens with a system message, except color_pick's and side_pick's (the tiny
        # model's one-word tasks need none, and a shorter prompt leaves more attention to the
        # image tokens; stock rows without one exist too)
        assert params["input"][0]["role"] == ("user" if name in ("color_pick", "side_pick") else "system")
        parsed = parse_run_request(orjson.dumps(row))
        assert parsed.responses_create_params is not None
        assert orjson.loads(orjson.dumps(row)) == row  # plain JSON, nothing lost on the way


@pytest.mark.parametrize("name", NAMES)
def test_rows_offer_exactly_the_servers_published_tools(
    name: str, rows: dict[str, list[dict[str, Any]]]
) -> None:
    published = get_env(name).server_class().function_tools()
    for row in rows[name]:
        if row.get("reveal") == "prompt":  # color_pick shows the image in the prompt: no tool is offered
            assert "tools" not in row["responses_create_params"]
            continue
        assert row["responses_create_params"].get("tools", []) == published


@pytest.mark.parametrize("name", NAMES)
def test_generation_is_deterministic_prefix_stable_and_seeded(
    name: str, rows: dict[str, list[dict[str, Any]]]
) -> None:
    spec = get_env(name)
    assert list(spec.generate(3, seed=11)) == rows[name]
    assert list(spec.generate(2, seed=11)) == rows[name][:2]  # row i does not depend on n
    assert list(spec.generate(3, seed=12)) != rows[name]
    assert spec.make_row(11, 2) == rows[name][2]


def _media_refs(row: dict[str, Any]) -> list[tuple[str, str]]:
    refs: list[tuple[str, str]] = []
    params = row["responses_create_params"]
    audio = params.get("metadata", {}).get("audio_data")
    if audio:
        refs.append(("audio", audio))
    for message in params["input"]:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part["type"] == "input_image":
                refs.append(("image", part["image_url"]))
            elif part["type"] == "input_video":
                refs.append(("video", part["video_url"]))
    return refs


@pytest.mark.parametrize("name", NAMES)
def test_row_media_decode_through_gymbridge_media(name: str, rows: dict[str, list[dict[str, Any]]]) -> None:
    spec = get_env(name)
    row = rows[name][0]
    refs = _media_refs(row)
    expected = {m for m in spec.modalities if m != "text"}
    if spec.style == "gymnasium":
        expected = set()  # images arrive with each observation, not in the row
    assert {modality for modality, _ in refs} == expected
    for modality, ref in refs:
        item = MediaItem.from_ref(ref, modality)  # type: ignore[arg-type]
        assert len(item.key) == 64 and item.nbytes > 0
        if modality == "image":
            assert item.image().size[0] > 0
        elif modality == "audio":
            samples, rate = item.audio()
            assert rate == 16000 and len(samples) == 3 * 16000
        else:
            assert item.video(fps=row["fps"], max_frames=64).shape == (row["num_frames"], 64, 64, 3)
