"""``--version`` for every command: ``scepsy 0.1.0``, from the installed package's metadata.

Role: one helper the three commands (``scepsy-proxy``, ``scepsy``, ``scepsy-engine``) share.
Invariant: the version is read only when ``--version`` is given, so building a parser costs
no metadata scan.
"""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Sequence
from typing import Any

DIST = "scepsy"


def version_text() -> str:
    """``scepsy <version>`` (``unknown`` when the package is not installed, e.g. run from a
    source tree without ``pip install -e``)."""
    try:
        version = importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"{DIST} {version}"


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(
            option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=kwargs.get("help")
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        print(version_text())  # stdout, as argparse's own version action
        parser.exit(0)


def add_version_argument(parser: argparse.ArgumentParser) -> None:
    """``--version``: print ``scepsy <version>`` and exit 0."""
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
