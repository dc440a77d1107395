"""Environment-variable references in settings (``os.environ/NAME``, ``${NAME}``), resolved once
by the loader, and ``--help-settings`` rows with each key's type and default."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.settings import (
    ROUTING_POLICIES,
    ProxySettings,
    Settings,
    SettingsError,
    cgroup_cpu_quota,
    describe,
    load_settings,
    settings_from_mapping,
)
from shared.settings_schema import env_reference, resolve_env

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,30}", fullmatch=True)


@given(NAMES)
def test_both_spellings_name_the_variable(name: str) -> None:
    assert env_reference(f"os.environ/{name}") == name
    assert env_reference(f"${{{name}}}") == name


@given(st.text())
def test_a_reference_is_the_whole_value_and_round_trips(text: str) -> None:
    name = env_reference(text)
    if name is not None:  # only the two exact spellings are references
        assert text in (f"os.environ/{name}", f"${{{name}}}")
    # Anything around a reference makes it a plain string, taken as written.
    assert env_reference(f"x{text}") is None
    assert resolve_env(text, None, "k") == text


@given(st.text(), NAMES)
def test_embedded_references_are_not_expanded(prefix: str, name: str) -> None:
    for ref in (f"os.environ/{name}", f"${{{name}}}"):
        value = f"{prefix}-{ref}"
        assert env_reference(value) is None
        assert resolve_env(value, {name: "secret"}, "k") == value


@given(NAMES, st.text())
def test_resolution_takes_the_variables_value(name: str, value: str) -> None:
    env = {name: value}
    assert resolve_env(f"os.environ/{name}", env, "k") == value
    assert resolve_env(f"${{{name}}}", env, "k") == value


def test_every_secret_reads_the_environment() -> None:
    env = {"ADMIN": "a-tok", "K1": "key-1", "UP": "up-key"}
    s = settings_from_mapping(
        {
            "proxy": {
                "admin_token": "os.environ/ADMIN",
                "client_keys": ["${K1}", "literal"],
                "upstreams": [{"model": "m", "url": "http://h:1", "api_key": "os.environ/UP"}],
            },
            "rollout": {"local": {"admin_token": "${ADMIN}"}},
        },
        env=env,
    )
    assert s.proxy.admin_token == "a-tok"
    assert s.proxy.client_keys == ("key-1", "literal")
    assert s.proxy.upstreams[0].api_key == "up-key"
    assert s.rollout.local.admin_token == "a-tok"


@pytest.mark.parametrize(
    ("doc", "path", "var"),
    [
        (
            {"proxy": {"admin_token": "os.environ/SCEPSY_ADMIN_TOKEN"}},
            "proxy.admin_token",
            "SCEPSY_ADMIN_TOKEN",
        ),
        ({"proxy": {"client_keys": ["ok", "${NOPE}"]}}, "proxy.client_keys[1]", "NOPE"),
        (
            {"proxy": {"upstreams": [{"model": "m", "url": "http://h", "api_key": "${UPK}"}]}},
            "proxy.upstreams[0].api_key",
            "UPK",
        ),
    ],
)
def test_an_unset_variable_is_one_line_naming_key_and_variable(
    doc: dict[str, object], path: str, var: str
) -> None:
    with pytest.raises(SettingsError) as info:
        settings_from_mapping(doc, env={})
    assert str(info.value) == f"{path}: environment variable {var} is not set"


def test_the_file_loader_reads_the_process_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "s.yaml"
    f.write_text("proxy:\n  admin_token: os.environ/SCEPSY_TEST_TOKEN\n")
    monkeypatch.setenv("SCEPSY_TEST_TOKEN", "from-env")
    assert load_settings(f).proxy.admin_token == "from-env"
    monkeypatch.delenv("SCEPSY_TEST_TOKEN")
    with pytest.raises(SettingsError, match="SCEPSY_TEST_TOKEN is not set"):
        load_settings(f)


def test_without_an_environment_references_stay_as_written() -> None:
    s = settings_from_mapping({"proxy": {"admin_token": "${X}"}}, env=None)
    assert s.proxy.admin_token == "${X}"


def test_help_rows_carry_type_and_default() -> None:
    rows = {r.key: r for r in describe(Settings)}
    assert rows["proxy.listen"].default == "127.0.0.1:8080"
    assert rows["proxy.admin_token"].type == "str | null"
    assert rows["proxy.admin_token"].default == "null"
    assert rows["proxy.client_keys"].type == "list[str]"
    assert rows["proxy.upstreams[].url"].default == "(required)"
    assert rows["proxy.routing.policy"].type == " | ".join(ROUTING_POLICIES)
    assert "consistent_hash" in ROUTING_POLICIES
    assert rows["proxy.access_log"].default == "false"
    assert rows["proxy.metrics_max_workflows"].default == "50"
    assert "os.environ/NAME" in rows["proxy.admin_token"].doc


def test_default_workers_follow_the_cpu_affinity_and_a_container_quota(tmp_path: Path) -> None:
    (tmp_path / "two").write_text("200000 100000\n")
    (tmp_path / "none").write_text("max 100000\n")
    (tmp_path / "junk").write_text("lots\n")
    assert cgroup_cpu_quota(str(tmp_path / "two")) == 2.0
    assert cgroup_cpu_quota(str(tmp_path / "none")) is None
    assert cgroup_cpu_quota(str(tmp_path / "junk")) is None
    assert cgroup_cpu_quota(str(tmp_path / "missing")) is None
    assert ProxySettings(workers=3).resolved_workers == 3
    assert 1 <= ProxySettings().resolved_workers <= len(os.sched_getaffinity(0))
