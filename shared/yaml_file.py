"""Reading one YAML input file (settings, scenario) into plain data, or a one-line error.

Role: the file edge shared by :func:`shared.settings.load_settings` and the optimizer's scenario
loader, so that whatever a path holds (a binary file, text in another encoding, a document
nested thousands of levels deep, a huge file) is a :class:`SettingsError` with one readable
line, never a ``UnicodeDecodeError`` or ``RecursionError`` traceback.

Invariants: the depth is checked on PyYAML's event stream (an iterative parser) before the
document is composed (recursive: about ten thousand levels overflow Python's stack), so a deep
document costs one linear scan; every message is one line and names the file; nothing is
decoded into settings here (see :func:`shared.settings_schema.decode`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from shared.settings_schema import SettingsError

__all__ = ["MAX_BYTES", "MAX_DEPTH", "parse_yaml", "read_yaml"]

MAX_BYTES = 16 * 1024 * 1024  # settings and scenarios are kilobytes; profiles are JSON files
MAX_DEPTH = 64  # the deepest settings key is about six levels down


def read_yaml(path: str | Path, what: str = "settings file") -> Any:
    """The YAML document in the file at ``path`` (``what`` it is, for messages)."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_BYTES + 1)
    except OSError as exc:
        raise SettingsError("", f"cannot read {what} {path}: {exc.strerror or exc}") from None
    return parse_yaml(raw, str(path), what)


def parse_yaml(raw: bytes, name: str, what: str = "settings file") -> Any:
    """The YAML document ``raw`` holds; ``name`` (the file's) heads every error."""
    if len(raw) > MAX_BYTES:
        raise SettingsError("", f"{what} {name} is larger than {MAX_BYTES // 2**20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SettingsError(
            "", f"{what} {name} is not UTF-8 text (byte {exc.start}): a binary file?"
        ) from None
    if "\x00" in text:
        raise SettingsError("", f"{what} {name} holds NUL bytes: a binary file?")
    try:
        _check_depth(text, name, what)
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SettingsError("", f"{name} is not valid YAML: {_one_line(exc)}") from None
    except RecursionError:  # not expected past _check_depth; a safety net all the same
        raise SettingsError("", f"{what} {name} is nested too deeply") from None


def _check_depth(text: str, name: str, what: str) -> None:
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                mark = event.start_mark
                where = f" (line {mark.line + 1})" if mark is not None else ""
                raise SettingsError(
                    "", f"{what} {name} is nested more than {MAX_DEPTH} levels deep{where}"
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _one_line(exc: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line: the problem and where it is."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        text = f"{exc.problem}{where}"
    else:
        text = str(exc)
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:197] + "..."
