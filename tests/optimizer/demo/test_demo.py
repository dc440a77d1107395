"""``scepsy demo --tiny`` end to end: proxy, emulated engines, daemon and load drivers as real
processes; the report holds what the issue asks for, every process is gone afterwards."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from optimizer.demo import run as demo
from optimizer.demo.report import problems
from optimizer.demo.run import DemoError, _check_load_driver, _watch


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line or environment mentions ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            blob = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if text.encode() in blob:
            found.append(int(entry.name))
    return found


@pytest.mark.slow  # the whole demo with short phases: ~90-140 s on two cores
@pytest.mark.skipif(
    not os.environ.get("SCEPSY_DEMO_TEST"),
    reason="takes ~2 minutes: set SCEPSY_DEMO_TEST=1 to run it",
)
@pytest.mark.timeout(300)
def test_tiny_demo_reports_one_rollout_after_the_shift_and_no_failed_request(
    tmp_path: Path,
) -> None:
    out = tmp_path / "demo"
    # run from elsewhere than the project, with a relative --out: the children must not
    # read the caller's relative paths from their own folder
    proc = subprocess.run(
        [sys.executable, "-m", "optimizer.cli", "demo", "--tiny", "--out", "demo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "COLUMNS": "120"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["label"] == "emulated"
    assert report["failed_requests"] == 0
    assert report["rollouts_after_shift"] >= 1 and report["problems"] == []
    for key in ("rollouts", "allocations", "predicted_vs_observed"):
        assert isinstance(report[key], list), key
    assert report["allocations"][0]["phase"] == "before shift"
    assert report["predicted_vs_observed"]
    assert {"beam", "rag"} <= {p["workflow"] for p in report["predicted_vs_observed"]}
    text = (out / "report.md").read_text()
    assert "EMULATED" in text and (out / "timeline.png").stat().st_size > 1000
    # Every process of the run (proxy, engines, load drivers) is gone.
    assert _processes_mentioning(str(out / "run")) == []


# --- failing loudly: the checks the demo runs, on real processes and report documents ---


def _doc(**changes: object) -> dict[str, object]:
    """A report document of a run that showed everything, with ``changes`` applied."""
    doc: dict[str, object] = {
        "load": [{"driver": "load-beam", "workflows": {"beam": {"completed": 40, "failed": 0}}}],
        "failed_requests": 0,
        "decisions": {"no_data": 2, "hold": 10, "rollout": 1},
        "rollouts_after_shift": 1,
        "predicted_vs_observed": [{"workflow": "beam"}],
    }
    return doc | changes


def test_a_run_that_showed_everything_has_no_problems() -> None:
    assert problems(_doc()) == []


def test_a_run_without_traffic_is_a_problem_whatever_else_it_shows() -> None:
    found = problems(
        _doc(
            load=[{"driver": "load-beam", "error": "exit status 1: ModuleNotFoundError: openai"}],
            decisions={"no_data": 19},
            rollouts_after_shift=0,
            predicted_vs_observed=[],
        )
    )
    assert found == [
        "load driver load-beam failed: exit status 1: ModuleNotFoundError: openai",
        "no client request completed",
        "the daemon never saw traffic (19 passes, none with data)",
    ]


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"failed_requests": 3}, "3 client requests failed"),
        ({"rollouts_after_shift": 0}, "no new allocation after the RAG rate tripled"),
        ({"predicted_vs_observed": []}, "no window after a rollout"),
        ({"decisions": {}}, "never saw traffic (0 passes"),
    ],
)
def test_each_shortfall_is_named(changes: dict[str, object], expected: str) -> None:
    found = problems(_doc(**changes))
    assert len(found) == 1 and expected in found[0]


@pytest.mark.timeout(30)
def test_a_load_driver_that_dies_ends_the_wait_naming_it(tmp_path: Path) -> None:
    log = tmp_path / "load-rag.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import no_such_module_for_scepsy"], stderr=err
        )
    try:
        with pytest.raises(
            DemoError,
            match=r"load driver load-rag exited with status 1: "
            r"ModuleNotFoundError.*no_such_module_for_scepsy",
        ):
            asyncio.run(_watch({"load-rag": proc}, tmp_path, 25.0))
    finally:
        proc.wait(5)


@pytest.mark.timeout(30)
def test_running_load_drivers_let_the_wait_end_on_time(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"])
    try:
        asyncio.run(_watch({"load-beam": proc}, tmp_path, 0.6))
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(5)


@pytest.mark.timeout(60)
def test_a_load_driver_that_cannot_import_stops_the_demo_before_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _check_load_driver()  # this venv has the demo extra
    monkeypatch.setattr(demo, "LOAD_DRIVER", "examples.no_such_driver")
    with pytest.raises(
        DemoError,
        match=r"load driver \(examples.no_such_driver\) cannot start: "
        r"ModuleNotFoundError.*pip install -e '.\[demo\]'",
    ):
        _check_load_driver()
