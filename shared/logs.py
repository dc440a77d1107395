"""Logging for every command: ``--log-level`` and ``--log-format text|json``, set up once.

Role: the one place the process's root logger is configured (``scepsy-proxy``, ``scepsy`` and
its subcommands, ``scepsy-engine``). ``text`` is one human line per record; ``json`` is one JSON
object per line with ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``msg``, the record's
``extra`` fields as they were given, and ``exc`` when it carries a traceback.

Invariants: a record never fails to format (values JSON cannot hold are written as strings,
text with lone surrogates is escaped), so a bad client-supplied string cannot make the process
print logging's own error instead of the line; configuring twice replaces the handler.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

import orjson

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")
LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def _jsonable(value: Any) -> Any:
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, then the ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in doc and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        try:
            return orjson.dumps(doc, default=_jsonable).decode()
        except (TypeError, orjson.JSONEncodeError):
            # orjson refuses lone surrogates (a client's undecodable bytes); json escapes them.
            return json.dumps(doc, default=_jsonable, ensure_ascii=True, separators=(",", ":"))


def configure(
    level: str = "INFO", fmt: LogFormat = "text", stream: TextIO | None = None
) -> logging.Handler:
    """Send every logger's records at ``level`` and above to ``stream`` (stderr) as ``fmt``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


def add_arguments(
    parser: argparse.ArgumentParser, default_level: str | None = "INFO", *, defaults: bool = True
) -> None:
    """``--log-level`` and ``--log-format`` (read back by :func:`configure_from_args`).
    ``defaults=False`` for a subcommand's parser: given after the subcommand they win, and
    absent they leave the main parser's values alone (argparse would overwrite them)."""
    parser.add_argument(
        "--log-level",
        default=default_level if defaults else argparse.SUPPRESS,
        type=str.upper,
        choices=LEVELS,
        help="least severe log records shown" + (f" ({default_level})" if default_level else ""),
    )
    parser.add_argument(
        "--log-format",
        default="text" if defaults else argparse.SUPPRESS,
        choices=FORMATS,
        help="text: one line per record; json: one JSON object per line with ts, level, "
        "logger, msg and the record's extra fields (text)",
    )


def configure_from_args(args: argparse.Namespace, level: str | None = None) -> logging.Handler:
    """Configure from ``--log-level``/``--log-format``; ``level`` replaces a level the
    command line left at its default of ``None``."""
    fmt: LogFormat = "json" if getattr(args, "log_format", "text") == "json" else "text"
    return configure(getattr(args, "log_level", None) or level or "INFO", fmt)
