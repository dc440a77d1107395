"""The ``scepsy`` command: a dispatcher over subcommands, one module per subcommand.

Role: parse the command line, hand the parsed arguments to the subcommand's ``run``, and turn
the optimizer's errors into one-line messages (exit status 2) instead of tracebacks.

Each subcommand module exposes ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. They are imported lazily, so ``scepsy stats`` does not pay for the
profiler's or the rollout backends' imports. Add a subcommand by adding one entry to
:data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence
from types import ModuleType

# name -> module. Later work adds profile, plan, run, render, demo, inventory.
COMMANDS: dict[str, str] = {
    "stats": "optimizer.stats_report",
    "inventory": "optimizer.inventory_cmd",
    "plan": "optimizer.plan_cmd",
    "render": "optimizer.render_cmd",
    "profile": "optimizer.profile_cmd",
    "run": "optimizer.run_cmd",
    "demo": "optimizer.demo",
}

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


def _module(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scepsy", description="Scepsy optimizer: statistics, profiles, plans, rollouts."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = _module(name)
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = _module(args.command).run(args)
    except UsageError as exc:
        print(f"scepsy {args.command}: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    raise SystemExit(main())
