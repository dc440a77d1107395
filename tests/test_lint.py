"""The style checks the project promises run with the tests, so CI holds them: the whole tree
is formatted by ``ruff format``, passes ``ruff check``, and type-checks under strict ``mypy``
(configured in ``pyproject.toml``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_tree_is_formatted() -> None:
    got = _run("ruff", "format", "--check", "--diff", ".", timeout=120)
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-2000:]


def test_ruff_check_passes() -> None:
    got = _run("ruff", "check", "--output-format", "concise", ".", timeout=120)
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-2000:]


@pytest.mark.timeout(600)
def test_strict_mypy_passes() -> None:
    got = _run("mypy", timeout=580)
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-2000:]
