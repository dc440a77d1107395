"""Logging set up once for every command (text or JSON lines), and ``--version`` on all three."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from optimizer.cli import main as optimizer_cli
from proxy import cli as proxy_cli
from shared import logs
from shared.version import version_text
from sim import cli as sim_cli


@pytest.fixture(autouse=True)
def _restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers[:]:
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_lines_carry_the_fields_and_the_extras() -> None:
    out = io.StringIO()
    logs.configure("INFO", "json", out)
    log = logging.getLogger("scepsy.test")
    log.info("hello %s", "there", extra={"model": "m", "duration_ms": 1.5, "thing": object()})
    log.debug("not shown")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    log.warning("bad bytes \udcff", extra={"workflow": "w\udcfe"})  # lone surrogates
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert first["level"] == "INFO" and first["logger"] == "scepsy.test"
    assert first["msg"] == "hello there" and first["model"] == "m"
    assert first["duration_ms"] == 1.5 and first["thing"].startswith("<object")
    assert first["ts"].endswith("+00:00")
    assert "ValueError: boom" in json.loads(lines[1])["exc"]
    assert json.loads(lines[2])["workflow"] == "w\udcfe"


def test_text_lines_and_reconfiguring_replaces_the_handler() -> None:
    out = io.StringIO()
    logs.configure("warning", "text", out)
    logs.configure("WARNING", "text", out)
    logging.getLogger("scepsy.test").warning("once")
    logging.getLogger("scepsy.test").info("hidden")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith("WARNING scepsy.test once")


Main = Callable[[Sequence[str]], Any]


@pytest.mark.parametrize(
    ("main", "argv"),
    [
        (proxy_cli.main, ["--version"]),
        (sim_cli.main, ["--version"]),
        (optimizer_cli.main, ["--version"]),
        (optimizer_cli.main, ["run", "--version"]),
        (optimizer_cli.main, ["stats", "--version"]),
    ],
)
def test_every_command_prints_its_version(
    main: Main, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out == version_text() + "\n" and out.startswith("scepsy 0.1.0")


def test_log_options_before_or_after_the_subcommand() -> None:
    parser = optimizer_cli.build_parser("run")
    args = parser.parse_args(["--log-level", "debug", "run", "--config", "x"])
    assert (args.log_level, args.log_format) == ("DEBUG", "text")
    args = parser.parse_args(["run", "--config", "x", "--log-format", "json"])
    assert (args.log_level, args.log_format) == (None, "json")
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--config", "x", "--log-level", "loud"])


def test_help_settings_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert proxy_cli.main(["--help-settings"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("proxy.listen "))
    assert row.split()[:3] == ["proxy.listen", "str", "127.0.0.1:8080"]
    assert "os.environ/NAME" in out
