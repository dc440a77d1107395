"""Settings: frozen dataclasses from YAML, and errors that name the key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.settings import SettingsError, load_settings, settings_from_mapping


def test_defaults_and_nested_values() -> None:
    s = settings_from_mapping(
        {
            "proxy": {
                "upstreams": [{"model": "m", "url": "http://h:1/"}],
                "routing": {"policy": "prefix_affinity"},
            }
        }
    )
    assert s.proxy.upstreams[0].url == "http://h:1"
    assert s.proxy.routing.policy == "prefix_affinity"
    assert s.store.segment_rows == 50_000
    with pytest.raises(AttributeError):
        s.proxy.listen = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("doc", "path"),
    [
        (
            {
                "proxy": {
                    "upstreams": [
                        {"model": "m", "url": "http://a"},
                        {"model": "m", "url": "ftp://b"},
                    ]
                }
            },
            "proxy.upstreams[1].url",
        ),
        ({"proxy": {"routing": {"policy": "random"}}}, "proxy.routing.policy"),
        ({"proxy": {"listen": "nohost"}}, "proxy.listen"),
        ({"proxy": {"max_body_bytes": "big"}}, "proxy.max_body_bytes"),
        ({"store": {"flush_interval_s": 0}}, "store.flush_interval_s"),
        ({"proxy": {"upstreams": [{"url": "http://a"}]}}, "proxy.upstreams[0].model"),
        ({"proxi": {}}, "proxi"),
    ],
)
def test_errors_name_the_key_path(doc: dict[str, object], path: str) -> None:
    with pytest.raises(SettingsError) as info:
        settings_from_mapping(doc)
    assert info.value.path == path
    assert str(info.value).startswith(path + ": ")


def test_load_file_and_bad_yaml(tmp_path: Path) -> None:
    good = tmp_path / "s.yaml"
    good.write_text("store:\n  path: /tmp/x\n")
    assert load_settings(good).store.path == "/tmp/x"
    bad = tmp_path / "b.yaml"
    bad.write_text("store: [\n")
    with pytest.raises(SettingsError, match="not valid YAML"):
        load_settings(bad)
