"""Third-party environments registered through the ``gymbridge.environments`` entry point group.

The environment lives in a package written into a temporary directory (a stand-in for an
installed distribution); its entry point is injected where ``importlib.metadata`` reads them.
"""

from __future__ import annotations

import io
import sys
from importlib import metadata
from pathlib import Path

import pytest

from gymbridge.cli import main as cli_main
from gymbridge.errors import ConfigError
from gymbridge_envs import registry

PKG = "thirdparty_echo_env"
FILES = {
    "__init__.py": (
        "from gymbridge_envs.registry import EnvSpec\n"
        "SPEC = EnvSpec('echo_word', 'say the word back', ('text',), 'tools', 'EchoServer', package_name='"
        + PKG
        + "')\n"
    ),
    "data.py": (
        "def make_row(seed, index, *, word='hello'):\n"
        "    return {'responses_create_params': {'input': [{'role': 'user', 'content': 'Say ' + word}]},"
        " 'word': word}\n"
        "def generate(n, seed=0, **params):\n"
        "    for i in range(n):\n"
        "        yield make_row(seed, i, **params)\n"
        "MAX_TURNS = 1\n"
    ),
    "server.py": (
        "from gymbridge.server import ResourcesServer, VerifyResult\n"
        "class EchoServer(ResourcesServer):\n"
        "    async def verify(self, session, row, response):\n"
        "        return VerifyResult(reward=0.0)\n"
    ),
}


@pytest.fixture
def echo_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    pkg = tmp_path / PKG
    pkg.mkdir()
    for name, text in FILES.items():
        (pkg / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [
        metadata.EntryPoint("echo_word", f"{PKG}:SPEC", registry.ENTRY_POINT_GROUP),
        metadata.EntryPoint("broken_env", "no_such_module_xyz:SPEC", registry.ENTRY_POINT_GROUP),
    ]

    monkeypatch.setattr(registry, "discover_entry_points", lambda: eps)
    yield "echo_word"
    for mod in [m for m in sys.modules if m.startswith(PKG)]:
        del sys.modules[mod]


def test_registered_env_shows_in_env_list(echo_env: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["env", "list"]) == 0
    out = capsys.readouterr().out
    assert "echo_word" in out and "say the word back" in out and "circle_click" in out
    assert "broken_env" not in out  # a plug-in that cannot load is logged and left out, not a crash


def test_a_broken_entry_point_is_a_config_error_naming_it(echo_env: str) -> None:
    with pytest.raises(ConfigError, match=r"broken_env.*no_such_module_xyz"):
        registry.get_env("broken_env")


@pytest.mark.integration
def test_smoke_trains_a_registered_env(echo_env: str, tmp_path: Path) -> None:
    from gymbridge.run import load_run_config, train

    sets = [("steps", 1), ("bridge.group_size", 4), ("rollout.max_tokens", 8)]
    sets += [("shaping.kind", "token_rate"), ("shaping.tokens", "hello")]
    cfg = load_run_config(["smoke"], sets, {"env": echo_env, "run_dir": str(tmp_path / "r")})
    result = train(cfg, out=io.StringIO())
    assert result.rollouts_ok == 8 and result.rollouts_failed == 0
    assert result.steps[0].num_loss_tokens > 0
