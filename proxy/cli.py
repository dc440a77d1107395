"""``scepsy-proxy``: run the proxy from a settings file or from command-line flags.

Role: the process edge: parse arguments into :class:`shared.settings.Settings`, serve the app
(in this process, or in ``proxy.workers`` worker processes: :func:`worker_main` is each one's
life), turn SIGTERM/SIGINT into a graceful shutdown (stop accepting, let in-flight calls finish for
``proxy.shutdown_grace_s``, flush the recorder), and report bad settings as one line naming
the key, exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from proxy.admin import install
from proxy.app import make_app, make_runner
from proxy.keys import METRICS, ROUTER, SIBLINGS
from proxy.siblings import Siblings
from proxy.workers import run_workers
from shared import logs
from shared.settings import (
    ROUTING_POLICIES,
    Settings,
    SettingsError,
    describe,
    load_settings,
    parse_host_port,
    settings_from_mapping,
)
from shared.settings_schema import ENV_HELP, document
from shared.version import add_version_argument

# uvloop where installed (the proxy's loop is its hot path), else asyncio's own.
try:
    import uvloop

    _UVLOOP: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
except ImportError:  # pragma: no cover - uvloop is a dependency on every platform but Windows
    _UVLOOP = None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scepsy-proxy", description="Scepsy's OpenAI-compatible sidecar proxy."
    )
    p.add_argument("--config", help="settings YAML file (other flags then override it)")
    p.add_argument("--listen", help="HOST:PORT to listen on (default 127.0.0.1:8080)")
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="MODEL=URL",
        help="an engine replica; repeat for more replicas and models",
    )
    p.add_argument("--store", help="trace store folder")
    p.add_argument("--workflow", help="default workflow name for calls that name none")
    p.add_argument("--routing", choices=ROUTING_POLICIES)
    p.add_argument(
        "--help-settings",
        action="store_true",
        help="list every settings key with its type, default and meaning, and exit",
    )
    logs.add_arguments(p)
    add_version_argument(p)
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = load_settings(args.config) if args.config else Settings()
    proxy: dict[str, object] = {}
    if args.listen:
        parse_host_port(args.listen, "--listen")
        proxy["listen"] = args.listen
    if args.upstream:
        ups = []
        for i, spec in enumerate(args.upstream):
            model, sep, url = spec.partition("=")
            if not sep or not model or not url:
                raise SettingsError(f"--upstream[{i}]", f"expected MODEL=URL, got {spec!r}")
            ups.append({"model": model, "url": url})
        proxy["upstreams"] = ups
    if args.workflow:
        proxy["default_workflow"] = args.workflow
    if not (args.config or args.upstream):
        raise SettingsError("--upstream", "give --config FILE or at least one --upstream MODEL=URL")
    return _merge(base, proxy, args)


def _merge(base: Settings, proxy: dict[str, object], args: argparse.Namespace) -> Settings:
    """Overlay flags on the file's settings and validate the result as one document."""

    doc = document(base)
    doc["proxy"].update(proxy)
    if args.routing:
        doc["proxy"]["routing"]["policy"] = args.routing
    if args.store:
        doc["store"]["path"] = args.store
    # The file's values were resolved when it was loaded: a secret that happens to read like
    # a reference must not be looked up a second time.
    return settings_from_mapping(doc, env=None)


async def listen(app: web.Application, host: str, port: int, *, reuse_port: bool) -> web.AppRunner:
    """Serve ``app`` on ``host:port``; the runner's ``addresses`` name the bound port."""
    runner = make_runner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True, reuse_port=reuse_port)
    await site.start()
    return runner


async def serve(settings: Settings, ready: asyncio.Event | None = None) -> None:
    """One process serving the proxy until SIGTERM or SIGINT."""
    app = make_app(settings)
    host, port = parse_host_port(settings.proxy.listen, "proxy.listen")
    runner = await listen(app, host, port, reuse_port=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # runner.addresses names what was really bound (port 0 asks the kernel for one).
    actual = runner.addresses[0][1] if runner.addresses else port
    print(
        f"scepsy-proxy listening on http://{host}:{actual} (store {settings.store.path})",
        flush=True,
    )
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        logging.getLogger("scepsy.proxy").info("shutting down: draining in-flight calls")
        await runner.cleanup()


def worker_main(
    doc: dict[str, Any], index: int, port: int, conn: Connection, log_setup: tuple[str, str]
) -> None:
    """A worker process's entry (the supervisor's spawn target, :mod:`proxy.workers`): ``doc``
    is the settings document (:func:`shared.settings_schema.document`), ``port`` the one the
    supervisor reserved, ``conn`` this worker's end of its pipe."""
    level, fmt = log_setup
    logs.configure(level, "json" if fmt == "json" else "text")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the supervisor stops us in order
    settings = settings_from_mapping(doc, env=None)
    with asyncio.Runner(loop_factory=_UVLOOP) as runner:
        runner.run(_serve_worker(settings, index, port, conn))


async def _serve_worker(settings: Settings, index: int, port: int, conn: Connection) -> None:
    app = make_app(settings)
    siblings = Siblings(
        conn,
        install=lambda ups: install(app, ups),
        expose=lambda: generate_latest(app[METRICS].registry),
        snapshot=app[ROUTER].snapshot,
    )
    app[SIBLINGS] = siblings
    host, _ = parse_host_port(settings.proxy.listen, "proxy.listen")
    runner = await listen(app, host, port, reuse_port=True)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, siblings.stop_asked.set)
    siblings.start()
    siblings.send("ready", 0)
    ended = [asyncio.ensure_future(e.wait()) for e in (siblings.stop_asked, siblings.parent_gone)]
    try:
        await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in ended:
            task.cancel()
        logging.getLogger("scepsy.proxy").info(
            "worker %d shutting down: draining in-flight calls", index
        )
        await runner.cleanup()
        siblings.close()


def _store_problem(path: str) -> str | None:
    """Why the trace store folder cannot be created or written, or None: said once, before
    any process serves (a recorder would otherwise fail in each worker)."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as exc:
        return f"cannot create or write {path}: {exc.strerror or exc}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.help_settings:
        print(f"{'key':42} {'type':28} {'default':24} meaning")
        for row in describe(Settings):
            print(f"{row.key:42} {row.type:28} {row.default:24} {row.doc}")
        print(f"\n{ENV_HELP}")
        return 0
    logs.configure_from_args(args)
    try:
        settings = settings_from_args(args)
    except SettingsError as exc:
        print(f"scepsy-proxy: bad settings: {exc}", file=sys.stderr)
        return 2
    problem = _store_problem(settings.store.path)
    if problem is not None:
        print(f"scepsy-proxy: bad settings: store.path: {problem}", file=sys.stderr)
        return 2
    workers = settings.proxy.resolved_workers
    try:
        if workers > 1:
            log_setup = (args.log_level or "INFO", args.log_format or "text")
            return run_workers(settings, workers, worker_main, log_setup)
        with asyncio.Runner(loop_factory=_UVLOOP) as runner:
            runner.run(serve(settings))
    except OSError as exc:
        print(
            f"scepsy-proxy: cannot listen on {settings.proxy.listen}: {exc.strerror}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
