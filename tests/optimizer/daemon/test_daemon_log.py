"""Every pass of the daemon logs one line with its decision's kind and reasons."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from optimizer.daemon.service import Daemon
from tests.optimizer.daemon.test_daemon import T0, FakeBackend, FakeClock, _settings, _trace


def _decisions(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == "decision"]


@pytest.mark.timeout(30)
async def test_each_pass_logs_its_decision(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="optimizer.daemon.service")
    daemon = Daemon(_settings(tmp_path), FakeBackend(), clock=FakeClock(T0))
    await daemon.tick()
    await daemon.tick()
    lines = _decisions(caplog)
    assert len(lines) == 2
    assert all(r.levelname == "INFO" and r.kind == "no_data" for r in lines)
    assert lines[0].getMessage().startswith("decision no_data: ")
    assert lines[0].reasons and lines[0].taken is False


@pytest.mark.timeout(60)
async def test_an_error_decision_is_a_warning_with_its_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="optimizer.daemon.service")
    _trace(tmp_path, [(1.0, 120.0)])  # traffic, but no profiles: the pass cannot plan
    await Daemon(_settings(tmp_path), FakeBackend(), clock=FakeClock(T0 + 100)).tick()
    [line] = _decisions(caplog)
    assert line.levelname == "WARNING" and line.kind == "error"
    assert "no profile" in line.getMessage()
