"""The ``optimizer.reprofile`` section: conservative defaults, values read, errors by key path."""

from __future__ import annotations

import pytest

from shared.settings import SettingsError, settings_from_mapping


def test_defaults_are_on_and_conservative() -> None:
    cfg = settings_from_mapping({}, env=None).optimizer.reprofile
    assert cfg.enabled and cfg.quick and not cfg.scaled_shares
    assert cfg.min_interval_s == 3600.0 and cfg.max_gpus == 1
    assert cfg.drift_windows >= 3 and cfg.drift_threshold >= 0.5 and cfg.min_requests >= 20


def test_values_are_read() -> None:
    doc = {"optimizer": {"reprofile": {"enabled": False, "max_gpus": 2, "calls_per_point": 300}}}
    cfg = settings_from_mapping(doc, env=None).optimizer.reprofile
    assert (cfg.enabled, cfg.max_gpus, cfg.calls_per_point) == (False, 2, 300)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("min_interval_s", -1),
        ("drift_threshold", 0),
        ("drift_windows", 0),
        ("min_requests", 0),
        ("max_gpus", 0),
        ("calls_per_point", 0),
    ],
)
def test_bad_values_name_their_key_path(key: str, value: float) -> None:
    with pytest.raises(SettingsError) as info:
        settings_from_mapping({"optimizer": {"reprofile": {key: value}}}, env=None)
    assert info.value.path == f"optimizer.reprofile.{key}"
