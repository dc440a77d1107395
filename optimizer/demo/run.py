"""``scepsy demo [--out DIR]``: the whole loop on an emulated 4-GPU node, in a few minutes.

Role: the README's first command. On this machine, with no GPU, it starts the local stack of
DESIGN §2 — a proxy process recording into a fresh trace store, emulated engines
(``scepsy-engine``) started by the local rollout backend, the optimizer daemon (in this
process) — drives beam search and RAG through the proxy with ``examples.load`` (subprocesses,
plain ``openai`` SDK), shows live what the daemon learns and decides, triples the RAG rate,
and writes ``DIR/report.md`` (with plots) and ``DIR/report.json``.

Schedule (:class:`DemoConfig`, wall seconds): profiles are computed by simulation in a
subprocess (``python -m sim.profiles``, as engines are ``sim.cli`` processes) while the proxy
and a bootstrap allocation (the settings' ``rollout.allocation``, placed and rolled out like
any other) start; load runs for ``warmup_s`` before the daemon starts (so that both workflows
have a full window of statistics), then ``before_s`` more at the base rates, then ``after_s``
with two more RAG drivers (3x). The daemon re-plans on its own: nothing here tells it when the
rate changed. Two of the four emulated GPUs are kept free (``optimizer.reserve_gpus``) so that
every rollout can start temporary copies there: make-before-break, no client request fails.

It fails loudly: the load driver's imports are checked before anything starts, a driver that
dies ends the run at once, and a run that completed no request, whose daemon never saw data,
or that showed no rollout after the shift exits non-zero with one line per reason
(:func:`optimizer.demo.report.problems`), after writing its report.

Invariants: every process this command starts is stopped on the way out (engines included,
unlike ``scepsy run``, which leaves them to the next daemon), on errors and Ctrl-C too; the
run folder ``DIR/run`` holds the settings, store, engine state and logs; every figure shown or
written is labelled emulated (or simulated, for the profiles).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from rich.console import Console
from rich.live import Live

from optimizer.control import proposal
from optimizer.daemon.service import Daemon, TickReport
from optimizer.demo.report import Pass, report_doc, write_report
from optimizer.demo.view import render
from optimizer.model.curves import ProfileBook
from optimizer.placement import ReplicaDemand, place
from optimizer.plan import target as plan_target
from optimizer.rollout.backend import converge
from optimizer.rollout.local.backend import LocalBackend
from optimizer.store.decisions import load_decisions
from optimizer.store.profiles import load_points, save_points
from shared.cluster import cluster_from_settings
from shared.ports import free_port
from shared.profile_points import import_json
from shared.settings import Settings, load_settings

BEAM_MODELS = ("llama-3.2-1b", "llama-3.1-8b-prm")
RAG_MODELS = ("e5-base-v2", "bge-reranker-base", "llama-3-8b")
FLOORS_GB = {
    "llama-3.2-1b": 6,
    "llama-3.1-8b-prm": 20,
    "llama-3-8b": 20,
    "e5-base-v2": 1,
    "bge-reranker-base": 1.5,
}  # as examples/cluster.yaml
# Before any search (on the two GPUs the search may use): beam's models share GPU 0, RAG's GPU 1.
BOOTSTRAP = [
    {"model": "llama-3.2-1b", "workflow": "beam", "share": 0.5},
    {"model": "llama-3.1-8b-prm", "workflow": "beam", "share": 0.5},
    {"model": "e5-base-v2", "workflow": "rag", "share": 0.25},
    {"model": "bge-reranker-base", "workflow": "rag", "share": 0.25},
    {"model": "llama-3-8b", "workflow": "rag", "share": 0.5},
]


@dataclass(frozen=True)
class DemoConfig:
    beam_rate: float = 0.4  # requests/s
    rag_rate: float = 1.0
    factor: int = 3  # RAG drivers after the shift
    beam: tuple[int, int, int] = (2, 2, 5)  # beams, width, iterations (kept light for 2 cores)
    passages: int = 200
    warmup_s: float = 30.0
    before_s: float = 60.0
    after_s: float = 130.0
    interval_s: float = 10.0
    window_s: float = 30.0
    windows_to_confirm: int = 4
    min_requests: int = 8
    profile_calls: int = 300


FULL = DemoConfig()
# For the end-to-end test: shorter phases and windows (the daemon's logic is the same).
TINY = DemoConfig(
    beam_rate=0.8,
    rag_rate=1.5,
    warmup_s=16.0,
    before_s=24.0,
    after_s=52.0,
    interval_s=4.0,
    window_s=12.0,
    windows_to_confirm=4,
    min_requests=4,
    profile_calls=200,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("scepsy-demo"),
        help="folder for report.md, report.json and the run (scepsy-demo)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="shorter phases and windows (about 2 minutes; for tests)",
    )


def settings_doc(run: Path, proxy_port: int, token: str, cfg: DemoConfig) -> dict[str, Any]:
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    return {
        "cluster": {
            "nodes": [
                {
                    "name": "demo-node",
                    "gpu_type": "a6000",
                    "gpus": 4,
                    "nvlink_domains": [[0, 1], [2, 3]],
                }
            ]
        },
        "store": {"path": str(run / "store"), "flush_interval_s": 1.0},
        "proxy": {
            "listen": f"127.0.0.1:{proxy_port}",
            "admin_token": token,
            "proxy_id": "demo-proxy",
            "shutdown_grace_s": 5.0,
        },
        "rollout": {
            "backend": "local",
            "drain_s": 3.0,
            "models": [
                {"name": m, "engine": "emulator", "min_memory_gb": FLOORS_GB[m]}
                for m in (*BEAM_MODELS, *RAG_MODELS)
            ],
            "allocation": BOOTSTRAP,
            "local": {
                "state_dir": str(run / "local"),
                "proxies": [proxy_url],
                "ready_timeout_s": 90.0,
                "stop_grace_s": 5.0,
            },
        },
        "optimizer": {
            "interval_s": cfg.interval_s,
            "window_s": cfg.window_s,
            "settle_s": 2.0,
            "min_requests": cfg.min_requests,
            "rate_change_threshold": 0.5,
            "windows_to_confirm": cfg.windows_to_confirm,
            "cooldown_s": 2 * cfg.window_s,
            "min_gain": 0.05,
            "horizon_s": 600.0,
            "cold_start_s": 3.0,
            "latency_drift_threshold": 1.0,
            "granularity": 4,
            "headroom": 0.1,
            # Two GPUs stay free for temporary copies: every rollout is make-before-break.
            "reserve_gpus": 2,
            "listen": "127.0.0.1:0",
        },
    }


class Stack:
    """The processes of one demo run, stopped in reverse order by :meth:`close`."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.procs: list[subprocess.Popen[bytes]] = []
        self.backend: LocalBackend | None = None

    def spawn(self, name: str, argv: list[str], stdout: Any = None) -> subprocess.Popen[bytes]:
        with open(self.run / f"{name}.log", "wb") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                argv,
                stdout=stdout or log,
                stderr=log,
                start_new_session=True,
                # The folder this package was imported from (the project, or site-packages
                # once installed): `python -m` there imports the same code this process runs.
                cwd=Path(__file__).resolve().parents[2],
            )
        self.procs.append(proc)
        return proc

    async def close(self) -> None:
        if self.backend is not None:
            with contextlib.suppress(Exception):
                observed = await self.backend.observe()
                for group in sorted({r.group for r in observed.replicas}):
                    await self.backend.stop(group)
            await self.backend.close()
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 8
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(proc.wait, max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def wait_http(url: str, timeout_s: float) -> None:
    """Until ``url`` answers 200 (polled every 0.2 s); ``RuntimeError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer within {timeout_s:.0f}s")
            await asyncio.sleep(0.2)


class DemoError(RuntimeError):
    """The demo cannot go on; the message is one line naming the cause."""


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


def _check_load_driver() -> None:
    """The load driver imports the ``openai`` SDK (the ``demo`` extra); without it every driver
    would die at its first line while the demo went on with no traffic."""
    probe = subprocess.run(
        [sys.executable, "-c", f"import {LOAD_DRIVER}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines() or ["(no output)"]
        raise DemoError(
            f"the load driver ({LOAD_DRIVER}) cannot start: {lines[-1]} "
            "(install the demo extra: pip install -e '.[demo]')"
        )


async def _watch(loads: dict[str, subprocess.Popen[bytes]], run: Path, seconds: float) -> None:
    """Sleep ``seconds`` while the load drivers run; a driver that dies ends the demo."""
    deadline = time.monotonic() + seconds
    while True:
        for name, proc in loads.items():
            code = proc.poll()
            if code not in (None, 0):
                raise DemoError(
                    f"load driver {name} exited with status {code}: "
                    f"{_last_line(run / f'{name}.log')}"
                )
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(0.5, left))


def _driver_report(name: str, proc: subprocess.Popen[bytes], run: Path) -> dict[str, Any]:
    assert proc.stdout is not None
    out = proc.stdout.read()
    if proc.returncode == 0:
        with contextlib.suppress(orjson.JSONDecodeError):
            report: dict[str, Any] = orjson.loads(out)
            return report | {"driver": name}
    return {
        "driver": name,
        "error": f"exit status {proc.returncode}: {_last_line(run / f'{name}.log')}",
    }


async def _wait_proc(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    try:
        return await asyncio.to_thread(proc.wait, timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{proc.args!r} did not finish within {timeout_s:.0f}s") from None


async def bootstrap(settings: Settings, backend: LocalBackend) -> None:
    """The settings' allocation, placed on the GPUs the search may use, rolled out."""
    cluster = cluster_from_settings(settings.cluster)
    usable = proposal.cluster_without(cluster, settings.optimizer.reserve_gpus)
    floors = {m.name: m.min_memory_bytes for m in settings.rollout.models}
    demands = [
        ReplicaDemand(e.workflow, e.model, e.tp, e.share, None, floors[e.model])
        for e in settings.rollout.allocation
        for _ in range(e.replicas)
    ]
    target = plan_target.target_from_placement(place(usable, demands), settings.rollout.revisions())
    await converge(backend, target, cluster=cluster)


LOAD_DRIVER = "examples.load"


def _load_argv(
    workflow: str, rate: float, duration: float, base_url: str, seed: int, cfg: DemoConfig
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        LOAD_DRIVER,
        "--workflow",
        workflow,
        "--rate",
        str(rate),
        "--duration",
        str(duration),
        "--base-url",
        base_url,
        "--seed",
        str(seed),
    ]
    if workflow == "beam":
        n, width, iterations = cfg.beam
        argv += ["--n", str(n), "--width", str(width), "--iterations", str(iterations)]
    else:
        argv += ["--passages", str(cfg.passages)]
    return argv


async def run_demo(out: Path, cfg: DemoConfig, console: Console) -> dict[str, Any]:
    t0, t0_wall = time.monotonic(), time.time()
    run = out / "run"
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    port, token = free_port(), secrets.token_hex(16)
    doc = settings_doc(run, port, token, cfg)
    (run / "settings.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    settings = load_settings(run / "settings.yaml")
    timeline: dict[str, float] = {}
    passes: list[Pass] = []
    book: ProfileBook | None = None
    phase = "starting the proxy and the bootstrap engines; profiling by simulation"
    notes = [f"run folder {run}; proxy http://127.0.0.1:{port}/v1"]
    stack = Stack(run)
    live = Live(
        render(phase, None, None, notes),
        console=console,
        refresh_per_second=2,
        auto_refresh=console.is_terminal,
    )

    def show() -> None:
        last = passes[-1].report if passes else None
        live.update(render(f"{phase}  [t={time.monotonic() - t0:.0f}s]", last, book, notes))
        if not console.is_terminal and last is not None:
            d = last.decision
            console.print(
                f"[t={time.monotonic() - t0:5.0f}s] {phase}: decision {d.kind}"
                + (f" ({last.outcome})" if last.outcome else "")
                + "".join(f"\n    - {r}" for r in d.reasons)
            )

    def on_tick(report: TickReport) -> None:
        passes.append(Pass(report.decision.t - t0_wall, report))
        show()

    loads: dict[str, subprocess.Popen[bytes]] = {}
    try:
        with live:
            await asyncio.to_thread(_check_load_driver)
            profiles = stack.spawn(
                "profiles",
                [
                    sys.executable,
                    "-m",
                    "sim.profiles",
                    "--out",
                    str(run / "profiles.json"),
                    "--beam",
                    ",".join(map(str, cfg.beam)),
                    "--calls",
                    str(cfg.profile_calls),
                ],
            )
            stack.spawn(
                "proxy",
                [
                    sys.executable,
                    "-m",
                    "proxy.cli",
                    "--config",
                    str(run / "settings.yaml"),
                    "--log-level",
                    "WARNING",
                ],
            )
            await wait_http(f"http://127.0.0.1:{port}/health", 60)
            stack.backend = LocalBackend.from_settings(
                settings, cluster_from_settings(settings.cluster)
            )
            await bootstrap(settings, stack.backend)
            timeline["bootstrap_ready"] = time.monotonic() - t0
            if await _wait_proc(profiles, 240) != 0:
                raise RuntimeError(f"profiling failed: see {run / 'profiles.log'}")
            simulated = import_json((run / "profiles.json").read_bytes())
            save_points(settings.store.path, simulated)
            book = ProfileBook(simulated)
            timeline["profiles_ready"] = time.monotonic() - t0
            phase = "traffic at base rates (beam search and RAG through the proxy)"
            show()
            base_url = f"http://127.0.0.1:{port}/v1"
            total = cfg.warmup_s + cfg.before_s + cfg.after_s
            for k, (wf, rate) in enumerate([("beam", cfg.beam_rate), ("rag", cfg.rag_rate)]):
                loads[f"load-{wf}"] = stack.spawn(
                    f"load-{wf}",
                    _load_argv(wf, rate, total, base_url, k, cfg),
                    stdout=subprocess.PIPE,
                )
            timeline["load_started"] = time.monotonic() - t0
            await _watch(loads, run, cfg.warmup_s)
            daemon = Daemon(settings, stack.backend, on_tick=on_tick)
            task = asyncio.create_task(daemon.run(), name="demo-daemon")
            timeline["daemon_started"] = time.monotonic() - t0
            phase = "the daemon watches, plans and rolls out"
            await _watch(loads, run, cfg.before_s)
            for k in range(1, cfg.factor):
                loads[f"load-rag-{k}"] = stack.spawn(
                    f"load-rag-{k}",
                    _load_argv("rag", cfg.rag_rate, cfg.after_s, base_url, 10 + k, cfg),
                    stdout=subprocess.PIPE,
                )
            timeline["shift"] = time.monotonic() - t0
            phase = f"RAG rate x{cfg.factor}: will the daemon notice?"
            show()
            await _watch(loads, run, cfg.after_s)
            # Arrivals end now: stop watching before the drivers' tails read as a shift.
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            timeline["daemon_stopped"] = time.monotonic() - t0
            phase = "waiting for the last requests"
            show()
            reports = []
            for name, proc in loads.items():
                await _wait_proc(proc, 300)
                reports.append(_driver_report(name, proc, run))
            timeline["load_done"] = time.monotonic() - t0
            phase = "done: writing the report"
            show()
        decisions = load_decisions(settings.store.path)
        timeline["total"] = time.monotonic() - t0
        points = load_points(settings.store.path)
        report = report_doc(
            passes, decisions, reports, timeline, doc, t0_wall, points, daemon.reprofiles
        )
        write_report(out, report, passes)
        return report
    finally:
        await stack.close()


def run(args: argparse.Namespace) -> int:
    console = Console()
    cfg = TINY if args.tiny else FULL
    try:
        # absolute: the children run from the package's folder, not from the caller's
        report = asyncio.run(run_demo(args.out.resolve(), cfg, console))
    except KeyboardInterrupt:
        console.print("scepsy demo: interrupted; every process it started was stopped")
        return 130
    except RuntimeError as exc:
        print(f"scepsy demo: {exc}", file=sys.stderr)
        return 1
    console.print(
        f"\n[bold]EMULATED[/bold]: {len(report['rollouts'])} rollout(s), "
        f"{report['rollouts_after_shift']} after the RAG rate tripled; "
        f"{report['failed_requests']} failed client requests; "
        f"{report['timeline_s']['total']:.0f}s. Report: {args.out / 'report.md'}"
    )
    for problem in report["problems"]:
        print(f"scepsy demo: {problem}", file=sys.stderr)
    return 1 if report["problems"] else 0
