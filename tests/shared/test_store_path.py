"""store.path: object storage is refused at load with one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.settings import SettingsError, load_settings, settings_from_mapping


@pytest.mark.parametrize("uri", ["s3://bucket/scepsy", "gs://bucket/x", "https://host/store"])
def test_object_store_uris_are_refused_naming_the_key(uri: str) -> None:
    with pytest.raises(SettingsError) as caught:
        settings_from_mapping({"store": {"path": uri}})
    scheme = uri.split(":", 1)[0]
    assert str(caught.value) == (
        f"store.path: object storage ({scheme}://...) is not supported yet; mount a volume"
    )


def test_a_refused_store_creates_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "settings.yaml"
    config.write_text("store:\n  path: s3://bucket/scepsy\n")
    with pytest.raises(SettingsError, match=r"^store\.path: object storage"):
        load_settings(config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["settings.yaml"]


def test_local_and_mounted_folders_are_accepted() -> None:
    for path in ("/var/lib/scepsy/store", "scepsy-store", "./data/store"):
        assert settings_from_mapping({"store": {"path": path}}).store.path == path
