"""The ``scepsy`` command: a dispatcher over subcommands, one module per subcommand.

Role: parse the command line, hand the parsed arguments to the subcommand's ``run``, and turn
the optimizer's errors into one-line messages (exit status 2) instead of tracebacks: a
:class:`UsageError` or a :class:`~shared.settings_schema.SettingsError` (an unreadable, binary,
too deep or out-of-range settings or scenario file) that a command lets through.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Only the
chosen subcommand's module is imported, so ``scepsy stats`` does not pay for the profiler's,
the daemon's or the rollout backends' imports (about a second). Add a subcommand by adding
one entry to :data:`COMMANDS`; a renamed one keeps its old name in :data:`ALIASES`.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from shared import logs
from shared.settings_schema import SettingsError
from shared.version import add_version_argument

# name -> (module, one-line help). The help lives here so that listing the commands imports
# none of them.
COMMANDS: dict[str, tuple[str, str]] = {
    "stats": (
        "optimizer.cli.stats",
        "summarise recorded calls per workflow and model (n, p, shares, latency)",
    ),
    "inventory": (
        "optimizer.cli.inventory",
        "list this node's GPUs and NVLink domains, and write them as cluster settings",
    ),
    "allocate": (
        "optimizer.cli.allocate",
        "search the GPU allocation for the workflows (from a store or a scenario) and place it",
    ),
    "render": (
        "optimizer.cli.render",
        "write the Kubernetes manifests (pods, services, routes) of the configured allocation",
    ),
    "profile": (
        "optimizer.cli.profile",
        "profile a model's throughput-latency curve by replaying its traced calls",
    ),
    "run": (
        "optimizer.cli.run",
        "run the optimizer daemon: watch traffic, re-plan on change, roll out",
    ),
    "demo": (
        "optimizer.demo.run",
        "run Scepsy end to end on an emulated 4-GPU node and write a report",
    ),
}

# old name -> command: an old name still runs its command, after one line on stderr saying
# the new name (scripts written for it keep working).
ALIASES: dict[str, str] = {"plan": "allocate"}

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h|d)?\s*$")
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


class UsageError(ValueError):
    """A bad command-line value; printed as ``scepsy: <message>``."""


def parse_duration_s(text: str) -> float:
    """``"15m"`` → 900.0; a bare number is seconds."""
    match = _DURATION.match(text)
    if not match:
        raise UsageError(f"not a duration: {text!r} (use e.g. 30s, 15m, 2h)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def existing_store(path: Path) -> Path:
    """``path`` when it is a folder: a command reading a store says so when it is missing,
    instead of reading it as empty."""
    if not path.exists():
        raise UsageError(f"store folder {path} does not exist")
    if not path.is_dir():
        raise UsageError(f"store {path} is not a folder")
    return path


# Top-level packages the extras bring (pyproject.toml): a command that needs one the install
# lacks says which extra to install instead of printing an ImportError traceback.
EXTRAS = {
    "kubernetes": "optimizer",
    "pynvml": "optimizer",
    "rich": "optimizer",
    "matplotlib": "plots",
    "openai": "demo",
}


class MissingExtraError(ImportError):
    """A subcommand imports a package that only one of scepsy's extras installs."""


def _module(name: str) -> ModuleType:
    try:
        return importlib.import_module(COMMANDS[name][0])
    except ModuleNotFoundError as exc:
        extra = EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        raise MissingExtraError(
            f"needs the {exc.name} package, which this install lacks: pip install 'scepsy[{extra}]'"
        ) from exc


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line (its first non-option word), if any."""
    first = next((a for a in argv if not a.startswith("-")), None)
    first = ALIASES.get(first, first) if first is not None else None
    return first if first in COMMANDS else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand with its help, and the arguments of ``command`` only: with no valid
    command argparse prints the usage, which needs none."""
    parser = argparse.ArgumentParser(
        prog="scepsy", description="Scepsy optimizer: statistics, profiles, allocations, rollouts."
    )
    add_version_argument(parser)
    # No default level here: the daemon (run) logs INFO, the one-shot commands WARNING.
    logs.add_arguments(parser, None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, text) in COMMANDS.items():
        aliases = [old for old, new in ALIASES.items() if new == name]
        sub_parser = sub.add_parser(name, aliases=aliases, help=text, description=text)
        add_version_argument(sub_parser)
        logs.add_arguments(sub_parser, "INFO" if name == "run" else "WARNING", defaults=False)
        if name == command:
            _module(name).add_arguments(sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(_chosen(words)).parse_args(words)
        if args.command in ALIASES:
            print(f"scepsy {args.command} is now scepsy {ALIASES[args.command]}", file=sys.stderr)
            args.command = ALIASES[args.command]
        logs.configure_from_args(args, "INFO" if args.command == "run" else "WARNING")
        code: int = _module(args.command).run(args)
    except (UsageError, MissingExtraError, SettingsError) as exc:
        # One line, whatever the message holds: a bad input is never a traceback (DESIGN §5).
        message = " ".join(str(exc).split())
        print(" ".join(filter(None, ["scepsy", _chosen(words)])) + f": {message}", file=sys.stderr)
        return 2
    return code
