"""What a user looks at after a run: rollouts/, media/, charts/ and a viewer that renders in Chromium."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest
from PIL import Image
from run_helpers import run_config

from gymbridge.run import train
from gymbridge.run.artifacts import CHARTS

pytestmark = pytest.mark.integration

SMALL = {
    "steps": 2,
    "bridge.prompts_per_step": 2,
    "bridge.group_size": 2,
    "warmup.steps": 4,
    "output.chart_every": 1,
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("artifacts") / "run"
    out = io.StringIO()
    train(run_config(path, SMALL), out=out)
    lines = out.getvalue().strip().splitlines()
    assert lines[0] == f"run dir: {path}"  # printed first
    assert lines[-2:] == [f"charts: {path / 'charts'}/", f"viewer: {path / 'viewer' / 'index.html'}"]  # last
    return path


def test_rollouts_of_every_step_with_turns_rewards_and_media_by_key(run_dir: Path) -> None:
    for step in (1, 2):
        rows = [
            orjson.loads(x) for x in (run_dir / "rollouts" / f"step_{step}.jsonl").read_bytes().splitlines()
        ]
        assert len(rows) == 4  # 2 prompts x G=2
        for r in rows:
            assert r["reward"] in (0.0, 1.0) and r["advantage"] is not None
            (turn,) = r["turns"]
            assert turn["generated_tokens"] == len(turn["generation_token_ids"]) > 0
            # the sampler's logprob of each generated token (a policy's confidence, per turn)
            assert len(turn["generation_logprobs"]) == turn["generated_tokens"]
            assert all(lp <= 0.0 for lp in turn["generation_logprobs"])
            assert isinstance(turn["text"], str)
            (media,) = turn["media"]
            assert (run_dir / media["path"]).is_file()
            assert media["path"] == f"media/{media['key']}.png"
            assert Image.open(run_dir / media["path"]).size == (56, 56)
    # each distinct image once on disk, however many rollouts show it
    assert len(list((run_dir / "media").iterdir())) <= 2


def test_charts_are_pngs(run_dir: Path) -> None:
    for stem in [*CHARTS, "payload"]:
        with Image.open(run_dir / "charts" / f"{stem}.png") as img:
            assert img.format == "PNG" and img.width >= 300


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def test_viewer_renders_rollouts_turns_and_images_in_headless_chromium(run_dir: Path, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        if os.environ.get("GYMBRIDGE_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium is required (CI): scripts/test.sh installs it with apt-get")
        pytest.skip("chromium is not installed (scripts/test.sh installs it)")
    url = (run_dir / "viewer" / "index.html").as_uri()
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run(
        [*common, "--virtual-time-budget=5000", "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert 'data-ready="1"' in dom, dom[:2000]  # the script ran
    assert dom.count('class="rollout ') == 8  # 2 steps x 4 rollouts
    assert dom.count('class="turn"') == 8
    assert dom.count('src="../media/') == 8 and "advantage" in dom and "reward" in dom
    shot = tmp_path / "viewer.png"
    subprocess.run(
        [*common, "--virtual-time-budget=5000", f"--screenshot={shot}", "--window-size=1000,1400", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    pixels = Image.open(shot).convert("RGB")
    colours = {c for _, c in pixels.getcolors(1 << 20) or []}
    # the rollouts' images rendered: the solid red / blue of color_pick appear in the screenshot
    from gymbridge_envs.color_pick.data import COLORS

    assert colours & {COLORS["red"], COLORS["blue"]}, "no rollout image rendered"
