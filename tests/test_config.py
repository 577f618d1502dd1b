"""Config loading: all problems reported at once, OmegaConf interpolation + overrides, unknown keys fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from gymbridge.config import StrictModel, load_config, parse_key_value, parse_override
from gymbridge.errors import ConfigError


class Inner(StrictModel):
    port: int
    host: str = "127.0.0.1"


class Cfg(StrictModel):
    name: str
    group_size: int
    inner: Inner


def test_loads_yaml_with_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GB_NAME", "demo")
    p = tmp_path / "c.yaml"
    p.write_text(
        "name: ${oc.env:GB_NAME}\ngroup_size: 4\ninner: {port: 8000, host: '${oc.env:GB_HOST,localhost}'}\n"
    )
    cfg = load_config(p, Cfg)
    assert cfg.name == "demo"
    assert cfg.inner.host == "localhost"
    assert cfg.inner.port == 8000


def test_every_problem_listed(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("group_size: many\ninner: {port: x, colour: red}\nname: ${oc.env:GB_SURELY_UNSET_VAR}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p, Cfg)
    problems = ei.value.problems
    joined = "\n".join(problems)
    assert "GB_SURELY_UNSET_VAR" in joined
    assert "group_size" in joined
    assert "inner.port" in joined
    assert "inner.colour" in joined  # unknown keys are errors, not ignored
    assert str(p) in str(ei.value)


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml", Cfg)
    bad = tmp_path / "b.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad, Cfg)
    top = tmp_path / "t.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(top, Cfg)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("lr=0.001", ("lr", 0.001)),
        ("trainer.steps=5", ("trainer.steps", 5)),
        ("name=", ("name", "")),
        (" flag = true", ("flag", True)),
        ("colour=[unclosed", ("colour", "[unclosed")),  # not YAML: kept as the plain string
        ("url=http://x:1/a=b", ("url", "http://x:1/a=b")),  # only the first '=' splits
    ],
)
def test_parse_key_value(text: str, expected: tuple[str, object]) -> None:
    assert parse_key_value(text) == expected


@pytest.mark.parametrize("text", ["novalue", "=5", "  =x"])
def test_parse_key_value_refuses_malformed(text: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        parse_key_value(text)


def test_interpolation_refers_to_other_keys_and_sees_the_overrides(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("name: run-${group_size}\ngroup_size: 4\ninner: {port: '${group_size}'}\n")
    assert load_config(p, Cfg).name == "run-4"
    cfg = load_config(p, Cfg, overrides=["group_size=8", "inner.host=0.0.0.0"])
    assert (cfg.name, cfg.inner.port, cfg.inner.host) == ("run-8", 8, "0.0.0.0")


def test_an_unresolvable_interpolation_names_its_key(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("name: ${nowhere}\ngroup_size: ${also.nowhere}\ninner: {port: 1}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p, Cfg)
    joined = "\n".join(ei.value.problems)
    assert joined.startswith("name: ") and "\ngroup_size: " in joined
    assert "field required" not in joined.lower()  # not reported twice


def test_a_bad_override_value_names_the_key(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("name: x\ngroup_size: 4\ninner: {port: 1}\n")
    with pytest.raises(ConfigError, match=r"inner\.port: .*integer"):
        load_config(p, Cfg, overrides=["inner.port=eighty"])
    with pytest.raises(ConfigError, match=r"inner\.colour"):
        load_config(p, Cfg, overrides=["inner.colour=red"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("name=", ""),  # empty is the empty string, not null
        ("name=[unclosed", "[unclosed"),  # not YAML: the plain text
        ("name=it's", "it's"),
        ("name=http://x:1/a=b", "http://x:1/a=b"),
        (" name = spaced", "spaced"),
    ],
)
def test_override_values_as_given(tmp_path: Path, override: str, expected: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("name: x\ngroup_size: 4\ninner: {port: 1}\n")
    assert load_config(p, Cfg, overrides=[override]).name == expected


def test_parse_override_refuses_malformed() -> None:
    import argparse

    assert parse_override("a.b=1") == "a.b=1"
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        parse_override("novalue")


def test_shell_style_env_references_name_the_key_and_the_omegaconf_syntax() -> None:
    """``${VAR}`` / ``${VAR:-default}`` (the syntax before OmegaConf) fail with the key and the fix."""
    with pytest.raises(ConfigError) as ei:
        load_config({"name": "${GB_HOST:-localhost}", "group_size": 1, "inner": {"port": "${GB_PORT}"}}, Cfg)
    problems = ei.value.problems
    assert [p.split(":")[0] for p in problems] == ["name", "inner.port"]
    assert all("${oc.env:NAME,default}" in p for p in problems)
