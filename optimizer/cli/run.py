"""``scepsy run --config FILE``: the optimizer daemon as a service.

Role: the process edge of :mod:`optimizer.daemon.service`: load the settings, build the rollout backend
named by ``rollout.backend`` (local processes, or Kubernetes from the in-cluster config or
``~/.kube/config``), serve ``/health`` and ``/metrics`` on ``optimizer.listen`` while the loop
runs, and stop on SIGTERM/SIGINT within seconds, leaving the engines running (the next daemon
adopts them). ``--once`` runs one pass and prints its decision as JSON instead.

Bad settings are one line naming the key (exit status 2), never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from typing import Any

import orjson
from aiohttp import web

from optimizer.cli.main import UsageError
from optimizer.daemon import service
from optimizer.daemon.service import Daemon
from optimizer.rollout.backend import Backend
from shared.cluster import ClusterError, cluster_from_settings
from shared.settings import Settings, SettingsError, load_settings, parse_host_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="settings YAML file")
    parser.add_argument(
        "--listen", help="HOST:PORT for /health and /metrics (default: optimizer.listen)"
    )
    parser.add_argument(
        "--once", action="store_true", help="run one pass, print its decision as JSON, and exit"
    )
    # --log-level and --log-format: every subcommand has them (optimizer.cli.main, shared.logs).


def make_backend(settings: Settings) -> Backend:
    cluster = cluster_from_settings(settings.cluster)
    if settings.rollout.backend == "kubernetes":
        from optimizer.rollout.kube.backend import KubeBackend, KubernetesApi

        return KubeBackend(KubernetesApi(), settings.rollout, cluster)
    from optimizer.rollout.local.backend import LocalBackend

    return LocalBackend.from_settings(settings, cluster)


async def _close(backend: Backend) -> None:
    close = getattr(backend, "close", None)
    if close is not None:
        await close()


async def serve(
    settings: Settings,
    backend: Backend,
    listen: str,
    stop: asyncio.Event | None = None,
    *,
    handle_signals: bool = True,
) -> None:
    """Serve the daemon until ``stop`` is set (SIGTERM/SIGINT set it)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT) if handle_signals else ():
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    host, port = parse_host_port(listen, "--listen")
    runner = web.AppRunner(service.make_app(Daemon(settings, backend)), handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        addresses = ", ".join(f"http://{a[0]}:{a[1]}" for a in runner.addresses) or listen
        print(f"scepsy run: health and metrics on {addresses}", file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()  # cancels the loop; engines keep running
        await _close(backend)


async def _once(settings: Settings, backend: Backend) -> dict[str, Any]:
    try:
        report = await Daemon(settings, backend).tick()
    finally:
        await _close(backend)
    d = report.decision
    return {
        "t": d.t,
        "kind": d.kind,
        "taken": d.taken,
        "outcome": report.outcome,
        "reasons": list(d.reasons),
    }


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
        listen = args.listen or settings.optimizer.listen
        parse_host_port(listen, "--listen")
        backend = make_backend(settings)
    except (SettingsError, ClusterError) as exc:
        raise UsageError(str(exc)) from exc
    if args.once:
        print(
            orjson.dumps(asyncio.run(_once(settings, backend)), option=orjson.OPT_INDENT_2).decode()
        )
        return 0
    asyncio.run(serve(settings, backend, listen))
    return 0
