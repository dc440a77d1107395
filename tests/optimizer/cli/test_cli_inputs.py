"""``scepsy`` as a user runs it (a subprocess) on bad inputs: one line on stderr and exit status 2,
never a traceback; and on a store with damaged segments: the commands go on, naming them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared.store import segment_dir
from tests.optimizer.daemon.test_daemon import _profiles, _settings_doc, _trace

ROOT = Path(__file__).resolve().parents[3]
SCENARIO = ROOT / "examples" / "scenario_paper.yaml"


def scepsy(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "optimizer.cli", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )


def _one_line_error(done: subprocess.CompletedProcess[str], expected: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], done.stderr


def _scenario(tmp_path: Path, key: str, value: str) -> Path:
    """The example scenario with the first workflow's ``key`` set to ``value`` as written."""
    text, count = re.subn(rf"(?m)^(    {key}:) \S+", rf"\1 {value}", SCENARIO.read_text(), count=1)
    assert count == 1
    path = tmp_path / f"scenario-{key}.yaml"
    path.write_text(text)
    return path


@pytest.mark.timeout(120)
def test_bad_settings_files_are_one_line_errors(tmp_path: Path) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(os.urandom(4096))
    deep = tmp_path / "deep.yaml"
    deep.write_text("optimizer: " + "[" * 10_000 + "]" * 10_000)
    granularity = tmp_path / "granularity.yaml"
    granularity.write_text(
        yaml.safe_dump({**_settings_doc(tmp_path), "optimizer": {"granularity": 10**8}})
    )
    no_cluster = tmp_path / "no-cluster.yaml"
    no_cluster.write_text(yaml.safe_dump({"store": {"path": str(tmp_path)}}))
    _one_line_error(scepsy("run", "--once", "--config", binary), "is not UTF-8 text")
    _one_line_error(scepsy("render", "--config", binary, "--out", tmp_path / "m"), "UTF-8")
    _one_line_error(scepsy("run", "--once", "--config", deep), "levels deep")
    _one_line_error(
        scepsy("run", "--once", "--config", granularity), "optimizer.granularity: must be at most"
    )
    _one_line_error(scepsy("run", "--once", "--config", no_cluster), "no cluster configured")


@pytest.mark.timeout(120)
def test_bad_scenarios_are_one_line_errors_naming_the_key(tmp_path: Path) -> None:
    _one_line_error(
        scepsy("allocate", "--scenario", _scenario(tmp_path, "rate", ".inf")),
        "workflows[0].rate: must be a finite number",
    )
    _one_line_error(
        scepsy("allocate", "--scenario", _scenario(tmp_path, "tool_time", ".nan")),
        "workflows[0].tool_time: must be a finite number",
    )
    _one_line_error(
        scepsy("allocate", "--scenario", SCENARIO, "--granularity", "100000000"),
        "--granularity must be between 1 and 100",
    )
    deep = tmp_path / "deep.yaml"
    deep.write_text("workflows:\n" + "- " * 5_000 + "x\n")
    _one_line_error(scepsy("allocate", "--scenario", deep), "levels deep")


@pytest.mark.timeout(120)
def test_a_missing_store_folder_is_an_error_not_an_empty_store(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    config = tmp_path / "settings.yaml"
    config.write_text(yaml.safe_dump(_settings_doc(tmp_path)))
    expected = f"store folder {missing} does not exist"
    _one_line_error(scepsy("stats", "--store", missing), expected)
    _one_line_error(scepsy("allocate", "--store", missing, "--config", config), expected)
    _one_line_error(scepsy("profile", "--store", missing, "--model", "m"), expected)


@pytest.mark.timeout(180)
def test_stats_allocate_and_a_daemon_pass_go_on_over_damaged_segments(tmp_path: Path) -> None:
    store = tmp_path / "store"
    _profiles(store)
    _trace(store, [(1.0, 120.0)])
    (segment,) = sorted(segment_dir(store, "simulated").glob("*.parquet"))
    truncated = segment.with_name("seg-truncated.parquet")
    truncated.write_bytes(segment.read_bytes()[:1000])
    garbage = segment.with_name("seg-garbage.parquet")
    garbage.write_bytes(os.urandom(5000))
    config = tmp_path / "settings.yaml"
    doc = _settings_doc(store, apply=False)
    config.write_text(yaml.safe_dump(doc))

    stats = scepsy("stats", "--store", store, "--window", "all", "--json")
    assert '"rag"' in stats.stdout and str(truncated) in stats.stderr, stats.stderr
    for done in (
        stats,
        scepsy("allocate", "--store", store, "--config", config, "--json"),
        scepsy("run", "--once", "--config", config),
    ):
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        assert str(truncated) in done.stderr and str(garbage) in done.stderr, done.stderr
        assert done.stdout.startswith("{"), done.stdout  # its JSON: the statistics, the
        # allocation, the pass's decision (no_data: the trace lies before the daemon's window)
