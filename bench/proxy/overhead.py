"""Benchmark: what the Scepsy proxy costs in latency, throughput and CPU, next to its peers.

``python -m bench.proxy.overhead --out DIR [--quick] [--pin]`` writes ``DIR/proxy_overhead.json``.

Set-up: a minimal upstream (``bench.proxy._upstream``: raw asyncio HTTP/1.1, pre-built vLLM-shaped
answers), then one server at a time in front of it, each its own process tree:
``scepsy-proxy`` (``python -m proxy.cli``, store in a temporary folder, a default workflow), the
vLLM router and the SGLang model gateway (``bench.proxy.peers``; each skipped with
``"skipped": "not installed"`` when its package is absent). As shipped, every server runs
unpinned with its own defaults (the proxy: one worker per usable core under a supervisor);
``--pin`` instead gives each server the first core alone (the proxy then with one worker) and the
upstream and the load generator the others.

Measured (all real measurements on this machine, nothing emulated):
- direct (client→upstream) requests/s and latency at each concurrency above 1, and direct
  streams, once; then for each server: a direct run at concurrency 1 right before its own (the
  added p50 is the difference of that pair), the proxied runs at each concurrency, and
  proxied streams (16 concurrent streams of 32 chunks, events counted by the client) — load from
  ``wrk`` when it is on PATH, an asyncio (aiohttp) client process otherwise; which one is
  recorded; streams always use the asyncio client;
- each run's CPU time of the loaded server summed over its whole process tree (supervisor and
  workers) and the host's busy share over the same window; idle CPUs before each phase;
- recorder records/s (in-process ``Recorder``, ``bench.proxy._recorder_speed``): a burst the queue
  holds, and a run offered at the target rate for several seconds (sustained: must drop nothing);
- after SIGTERM of the proxy, the records its store holds against the POSTs that reached the
  upstream through it while it ran, and the ``recorder closed`` lines of all its workers summed.

This module holds the run's shape, plans the jobs of each phase, runs them and assembles the
report; the server processes are ``bench.proxy.servers``, the summary, targets and notes
``bench.proxy.overhead_report``.

Invariants: every figure in ``summary`` is computed from the measurements in the same file;
``targets`` states each target of issues 2 and 26 and whether this run met it (``met`` is null
where a figure it needs was not measured, e.g. a peer not installed); every server this module
starts is killed (its whole process tree) before its phase returns, whether it ran or failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from bench.proxy._load import (
    Cpus,
    Job,
    LoadResult,
    StreamResult,
    run_client,
    run_wrk,
    wrk_path,
)
from bench.proxy._recorder_speed import measure_recorder, store_rows
from bench.proxy.overhead_report import contention_notes, judge, print_http, summarise
from bench.proxy.peers import PEERS, SCEPSY, Peer
from bench.proxy.servers import (
    BODY,
    ROUTE,
    STREAM_BODY,
    Placement,
    Server,
    idle_cpus,
    recorder_totals,
    scepsy_command,
    upstream_stats,
    worker_count,
)
from shared.ports import free_port

# ``Server`` is imported from here by ``bench.proxy.upstream_client``.
__all__ = ["FULL", "QUICK", "RunShape", "Server", "main", "run_benchmark", "write_report"]

DIRECT = (("X-Bench-Direct", "1"),)


@dataclass(frozen=True)
class RunShape:
    """One benchmark run's shape: how long each load runs, the concurrencies, the stream
    and recorder loads."""

    duration_s: float
    warmup_s: float
    stream_duration_s: float
    stream_chunks: int
    recorder_burst: int  # records submitted unpaced (the recorder's queue holds them all)
    recorder_paced: int  # records offered at ``recorder_rate``
    recorder_rate: float  # the target rate: the paced run shows it is sustained, none dropped
    concurrencies: tuple[int, ...] = (1, 16, 64)
    stream_concurrency: int = 16


QUICK = RunShape(2.0, 1.0, 2.0, 32, 100_000, 50_000, 50_000.0, concurrencies=(1, 16))
FULL = RunShape(10.0, 2.0, 10.0, 32, 200_000, 500_000, 50_000.0)


def _job(shape: RunShape, url: str, c: int, stream: bool, headers: Any, pid: int) -> Job:
    body, seconds = (STREAM_BODY, shape.stream_duration_s) if stream else (BODY, shape.duration_s)
    job = Job(url + ROUTE, body.decode(), c, seconds, shape.warmup_s, stream=stream)
    return replace(job, headers=headers, cpu_pid=pid)


def plan_direct(shape: RunShape, upstream: Server) -> list[tuple[str, Job]]:
    """The direct reference runs: each concurrency above 1, then the streams. Direct jobs
    carry ``X-Bench-Direct`` (see bench.proxy._upstream) and watch the upstream's CPU."""
    pid = upstream.proc.pid
    jobs = [
        ("direct", _job(shape, upstream.url, c, False, DIRECT, pid)) for c in shape.concurrencies
    ]
    jobs = [j for j in jobs if j[1].concurrency > 1]
    return [
        *jobs,
        ("direct", _job(shape, upstream.url, shape.stream_concurrency, True, DIRECT, pid)),
    ]


def plan_server(shape: RunShape, upstream: Server, server: Server) -> list[tuple[str, Job]]:
    """One server's runs: direct at concurrency 1 (its pair), then through the server at
    each concurrency, then its streams; the server's jobs watch its process tree."""
    pid = server.proc.pid
    jobs = [("direct", _job(shape, upstream.url, 1, False, DIRECT, upstream.proc.pid))]
    jobs += [(server.kind, _job(shape, server.url, c, False, (), pid)) for c in shape.concurrencies]
    jobs.append((server.kind, _job(shape, server.url, shape.stream_concurrency, True, (), pid)))
    return jobs


def run_jobs(jobs: list[Job], client: str, cpus: Cpus) -> list[LoadResult | StreamResult]:
    """``wrk`` runs each plain job (streams always use the asyncio client: ``wrk`` cannot
    count events); the asyncio client runs its jobs in one child process."""
    if client != "wrk":
        return run_client(jobs, cpus)
    threads = len(cpus) if cpus else os.cpu_count() or 1
    streamed = iter(run_client([j for j in jobs if j.stream], cpus))
    return [next(streamed) if j.stream else run_wrk(j, threads, cpus) for j in jobs]


def _run_phase(
    jobs: list[tuple[str, Job]], client: str, place: Placement
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``jobs``; (plain runs, streams by target)."""
    results = run_jobs([j for _, j in jobs], client, place.others)
    runs: list[dict[str, Any]] = []
    streams: dict[str, Any] = {}
    for (target, job), res in zip(jobs, results, strict=True):
        if job.stream:
            streams[target] = res.as_dict()
        else:
            runs.append({"target": target, **res.as_dict()})
    return runs, streams


def measure_server(
    name: str,
    peer: Peer | None,
    shape: RunShape,
    client: str,
    place: Placement,
    upstream: Server,
    logs: Path,
) -> dict[str, Any]:
    """One server's phase: start it, load it, stop it (the proxy: SIGTERM, then the store
    check). A peer not installed, or that does not start, is reported skipped."""
    if peer is not None and peer.missing():
        return {"skipped": peer.missing(), "package": peer.package}
    idle = idle_cpus()
    store = logs / "store"
    before = upstream_stats(upstream)
    if peer is None:
        cmd = scepsy_command(upstream, store, place, logs)
        port: int | None = None
    else:
        port = free_port()
        cmd = peer.command(upstream.url, port)
    try:
        server = Server(name, cmd, place.server, logs, port=port)
    except RuntimeError as e:
        return {"skipped": f"did not start: {e}", "command": cmd}
    try:
        runs, streams = _run_phase(plan_server(shape, upstream, server), client, place)
        t_stop = time.perf_counter()
        code = server.stop(signal.SIGTERM, timeout_s=60.0 if peer is None else 15.0)
        shutdown_s = time.perf_counter() - t_stop
    finally:
        server.kill()
    out: dict[str, Any] = {"command": cmd, "idle_cpus_before": idle, "http": runs}
    out["streaming"] = streams[name]
    if peer is None:
        out["workers"] = worker_count(server)
        out["store_check"] = store_check(before, upstream, server, store, code, shutdown_s)
    else:
        out.update(package=peer.package, version=peer.version(), policy=peer.policy)
        out.update(notes=peer.notes, exit_code=code)
    return out


def measure_http(shape: RunShape, client: str, place: Placement, logs: Path) -> dict[str, Any]:
    """Upstream up; the direct reference runs; then each server's phase in turn."""
    upstream = Server(
        "upstream",
        [sys.executable, "-m", "bench.proxy._upstream", "--chunks", str(shape.stream_chunks)],
        place.others,
        logs,
    )
    try:
        idle = idle_cpus()
        runs, streams = _run_phase(plan_direct(shape, upstream), client, place)
        direct = {"idle_cpus_before": idle, "http": runs, "streaming": streams["direct"]}
        servers: dict[str, Any] = {}
        for name, peer in ((SCEPSY, None), *((p.name, p) for p in PEERS)):
            servers[name] = measure_server(name, peer, shape, client, place, upstream, logs)
        return {
            "expected_events_per_stream": shape.stream_chunks + 1,
            "direct": direct,
            "servers": servers,
        }
    finally:
        upstream.kill()


def store_check(
    before: dict[str, int],
    upstream: Server,
    proxy: Server,
    store: Path,
    code: int | None,
    shutdown_s: float,
) -> dict[str, Any]:
    """The stopped proxy's store against the POSTs that reached the upstream through it
    (those of its phase without ``X-Bench-Direct``)."""
    after = upstream_stats(upstream)
    via_proxy = (after["posts"] - before["posts"]) - (
        after["direct_posts"] - before["direct_posts"]
    )
    closed = recorder_totals(proxy.err.read_text(errors="replace"))
    on_disk = store_rows(str(store))
    return {
        "posts_via_proxy": via_proxy,
        "records_in_store": on_disk,
        "records_lost": max(0, via_proxy - on_disk),
        "records_extra": max(0, on_disk - via_proxy),
        "proxy_recorder_written": closed["written"] if closed else None,
        "proxy_recorder_dropped": closed["dropped"] if closed else None,
        "proxy_recorders_closed": closed["recorders"] if closed else 0,
        "proxy_exit_code": code,
        "shutdown_s": round(shutdown_s, 3),
    }


def measure_recorder_runs(shape: RunShape, place: Placement) -> dict[str, Any]:
    """The recorder on the server's core when pinned (every server has stopped by now): a
    burst the queue holds, then a paced run at ``shape.recorder_rate``."""
    own = os.sched_getaffinity(0)
    if place.server:
        os.sched_setaffinity(0, place.server)
    try:
        burst = asyncio.run(measure_recorder(shape.recorder_burst))
        paced = asyncio.run(measure_recorder(shape.recorder_paced, rate=shape.recorder_rate))
    finally:
        os.sched_setaffinity(0, own)
    for name, r in (("burst", burst), ("paced", paced)):
        print(f"recorder {name:5} {r.records_per_s:>10.0f} records/s, dropped {r.dropped}")
    return {"burst": burst.as_dict(), "paced": paced.as_dict()}


def run_benchmark(shape: RunShape, client: str = "auto", pin: bool = False) -> dict[str, Any]:
    """Every measurement of this benchmark, with summary and targets."""
    if client == "auto":
        client = "wrk" if wrk_path() else "aiohttp"
    place = Placement.choose(pin)
    started = time.perf_counter()
    idle_before, load_before = idle_cpus(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="scepsy-bench-proxy-") as tmp:
        http = measure_http(shape, client, place, Path(tmp))
    print_http(http)
    load_after = os.getloadavg()
    recorder = measure_recorder_runs(shape, place)
    summary = summarise(http, recorder)
    return {
        "benchmark": "proxy_overhead",
        "kind": "measured",
        "machine": {
            "cpu_count": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_client": client,
            "placement": place.describe(),
            "idle_cpus_before": idle_before,
            "loadavg_1m_before": round(load_before[0], 2),
            "loadavg_1m_after_http": round(load_after[0], 2),
        },
        "config": {
            **asdict(shape),
            "load_client": client,
            "stream_client": "aiohttp",
            "request_body": BODY.decode(),
            "stream_body": STREAM_BODY.decode(),
            "pinned": pin,
        },
        **http,
        "recorder": recorder,
        "summary": summary,
        "targets": judge(summary),
        "notes": contention_notes(http, place, client),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


def write_report(report: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "proxy_overhead.json"
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.proxy.overhead", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--out", required=True, help="folder for proxy_overhead.json")
    p.add_argument("--quick", action="store_true", help="short runs (about a minute)")
    p.add_argument("--client", choices=["auto", "wrk", "aiohttp"], default="auto")
    p.add_argument(
        "--pin",
        action="store_true",
        help="give each server the first core alone (the proxy: one worker) instead of "
        "running everything unpinned as shipped",
    )
    args = p.parse_args(argv)
    report = run_benchmark(QUICK if args.quick else FULL, args.client, args.pin)
    path = write_report(report, Path(args.out))
    for key, t in report["targets"].items():
        verdict = "n/a" if t["met"] is None else "met" if t["met"] else "NOT met"
        print(f"{key:34} {t['value']!s:>10}  target {t['target']:>8}  {verdict}")
    print(f"wrote {path} in {report['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
