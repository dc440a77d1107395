"""Whatever a settings file holds, loading it is a Settings or one SettingsError line: arbitrary
bytes, arbitrary text, generated documents over the real keys (hypothesis), binary files, deep
nesting, non-finite numbers and huge integers, with the key path named."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.settings import Settings, SettingsError, describe, load_settings
from shared.yaml_file import MAX_DEPTH, parse_yaml

# Every key name the settings know, so generated documents reach the sections' own checks.
KEYS = sorted({row.key.rsplit(".", 1)[-1].removesuffix("[]") for row in describe(Settings)})
SECTIONS = sorted({row.key.split(".", 1)[0] for row in describe(Settings)})

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # .inf, .nan included
    st.text(max_size=40),
    st.sampled_from(["127.0.0.1:0", "http://h:1", "0.0.0.0:²", "${UNSET_VAR}", "a\nb", ""]),
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=25,
)
_documents = st.dictionaries(st.sampled_from(SECTIONS), _values, max_size=5)


def _load(raw: bytes) -> Settings | SettingsError:
    fd, name = tempfile.mkstemp(suffix=".yaml")
    try:
        os.write(fd, raw)
        os.close(fd)
        try:
            return load_settings(name)
        except SettingsError as exc:
            message = str(exc)
            assert "\n" not in message and len(message) < 2000, message
            return exc
    finally:
        os.unlink(name)


_quick = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.timeout(120)
@_quick
@given(st.binary(max_size=3000))
def test_any_bytes_load_or_fail_in_one_line(raw: bytes) -> None:
    _load(raw)


@pytest.mark.timeout(120)
@_quick
@given(st.text(max_size=300))
def test_any_text_loads_or_fails_in_one_line(text: str) -> None:
    _load(text.encode("utf-8", "surrogatepass"))


@pytest.mark.timeout(120)
@_quick
@given(_documents)
def test_any_document_over_the_real_keys_loads_or_fails_in_one_line(doc: dict[str, Any]) -> None:
    _load(yaml.safe_dump(doc).encode())


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a: " + "[" * 10_000 + "]" * 10_000, f"nested more than {MAX_DEPTH} levels deep"),
        ("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 200)), "levels deep"),
        ("optimizer: {granularity: 10000000}", "optimizer.granularity: must be at most 100"),
        ("optimizer: {interval_s: .inf}", "optimizer.interval_s: must be a finite number"),
        ("optimizer: {headroom: .nan}", "optimizer.headroom: must be a finite number"),
        ("optimizer: {min_gain: 1.0e+400}", "optimizer.min_gain: must be a finite number"),
        ("store: {queue_size: 99999999999999999999}", "store.queue_size: out of range"),
        ("optimizer: {window_s: 99999999999999999999999}", "optimizer.window_s: out of range"),
        ("proxy: {listen: '0.0.0.0:²'}", "proxy.listen: expected HOST:PORT"),
        ("optimizer: [1, 2", "is not valid YAML"),
        ("a: b\x00", "NUL bytes"),
    ],
)
def test_bad_documents_are_one_line_naming_what_is_wrong(text: str, expected: str) -> None:
    result = _load(text.encode())
    assert isinstance(result, SettingsError) and expected in str(result), result


@pytest.mark.timeout(30)
def test_binary_missing_and_folder_paths_are_one_line(tmp_path: Path) -> None:
    binary = tmp_path / "settings.yaml"
    binary.write_bytes(bytes(range(256)) * 8)
    for path, expected in (
        (binary, "is not UTF-8 text"),
        (tmp_path / "absent.yaml", "cannot read settings file"),
        (tmp_path, "cannot read settings file"),
    ):
        with pytest.raises(SettingsError, match=expected) as info:
            load_settings(path)
        assert "\n" not in str(info.value)


def test_a_document_at_the_depth_bound_still_parses() -> None:
    inner = MAX_DEPTH - 1  # the top mapping is a level
    assert parse_yaml(("a: " + "[" * inner + "]" * inner).encode(), "f") is not None
    with pytest.raises(SettingsError, match="levels deep"):
        parse_yaml(("a: " + "[" * MAX_DEPTH + "]" * MAX_DEPTH).encode(), "f")
