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

Invariants: every figure in ``summary`` is computed from the measurements in the same file;
``targets`` states each target of issues 2 and 26 and whether this run met it (``met`` is null
where a figure it needs was not measured, e.g. a peer not installed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from bench.proxy._load import (
    Cpus,
    Job,
    LoadResult,
    StreamResult,
    popen,
    run_client,
    run_wrk,
    wrk_path,
)
from bench.proxy._recorder_speed import measure_recorder, store_rows
from bench.proxy.peers import PEERS, SCEPSY, Peer
from shared.ports import free_port

MODEL = "bench"
WORKFLOW = "bench"
ROUTE = "/v1/chat/completions"
BODY = orjson.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 16}
)
STREAM_BODY = orjson.dumps({**orjson.loads(BODY), "stream": True})
DIRECT = (("X-Bench-Direct", "1"),)
_LISTENING = {
    "upstream": re.compile(r"upstream listening on (\d+)"),
    SCEPSY: re.compile(r"scepsy-proxy listening on http://[^:]+:(\d+)"),
}
_RECORDER_CLOSED = re.compile(r"recorder closed: (\d+) written, (\d+) dropped")


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


@dataclass(frozen=True)
class Target:
    """A target of an issue on one summary figure (a path of keys into ``summary``)."""

    issue: int
    path: tuple[str, ...]
    op: str  # "<=", ">=" or "=="
    bound: float


TARGETS: dict[str, Target] = {
    "added_p50_ms_c1": Target(2, ("added_p50_ms_c1",), "<=", 0.5),
    "proxied_rps_c16": Target(2, ("proxied_rps_c16",), ">=", 4000.0),
    "stream_events_per_s": Target(2, ("stream_events_per_s",), ">=", 25000.0),
    "recorder_records_per_s": Target(2, ("recorder_records_per_s",), ">=", 50000.0),
    "records_dropped": Target(2, ("records_dropped",), "==", 0.0),
    "rps_c16_over_sglang_router": Target(26, ("ratios", "rps_c16_over_sglang_router"), ">=", 1.0),
    "rps_c16_over_vllm_router": Target(26, ("ratios", "rps_c16_over_vllm_router"), ">=", 0.8),
    "added_p50_ms_c1_issue26": Target(26, ("added_p50_ms_c1",), "<=", 0.15),
    "stream_events_over_vllm_router": Target(
        26, ("ratios", "stream_events_over_vllm_router"), ">=", 1.0
    ),
    "stream_events_over_sglang_router": Target(
        26, ("ratios", "stream_events_over_sglang_router"), ">=", 1.0
    ),
    "records_lost": Target(26, ("records_lost",), "==", 0.0),
}


@dataclass(frozen=True)
class Placement:
    """Which cores the loaded server and everything else (upstream, load generator) may use."""

    server: Cpus
    others: Cpus

    @staticmethod
    def choose(pin: bool) -> Placement:
        cpus = sorted(os.sched_getaffinity(0))
        if not pin or len(cpus) < 2:
            return Placement(None, None)
        return Placement(frozenset(cpus[:1]), frozenset(cpus[1:]))

    def describe(self) -> dict[str, Any]:
        return {
            "server_cpus": sorted(self.server) if self.server else "unpinned",
            "upstream_and_client_cpus": sorted(self.others) if self.others else "unpinned",
        }


class Server:
    """A server child process (its own session, so its whole tree can be killed) whose
    stdout/stderr go to files. Ready when it prints its port (``kind`` in ``_LISTENING``), or,
    given ``port``, when a POST of the benchmark's body to it answers 200."""

    def __init__(
        self,
        kind: str,
        cmd: list[str],
        cpus: Cpus,
        logs: Path,
        port: int | None = None,
        ready_s: float = 30.0,
    ) -> None:
        self.kind = kind
        self.cmd = cmd
        self.out = logs / f"{kind}.out"
        self.err = logs / f"{kind}.err"
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = popen(cmd, cpus, stdout=out, stderr=err, start_new_session=True)
        self.port = self._wait_ready(ready_s, port)

    def _wait_ready(self, timeout_s: float, port: int | None) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if port is not None and _answers(f"http://127.0.0.1:{port}{ROUTE}"):
                return port
            m = None if port is not None else _LISTENING[self.kind].search(self._text(self.out))
            if m:
                return int(m[1])
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        why = "exited" if self.proc.returncode is not None else f"not ready in {timeout_s:g} s"
        raise RuntimeError(f"{self.kind} did not start ({why}): {self._text(self.err)[-1500:]}")

    @staticmethod
    def _text(path: Path) -> str:
        return path.read_text(errors="replace")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int | None:
        """Signal the process and wait for it; kill its whole tree if it outlives
        ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the process's whole session (workers included) and reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _answers(url: str) -> bool:
    req = urllib.request.Request(url, BODY, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def idle_cpus(seconds: float = 0.5) -> float | None:
    """How many CPUs sat idle over ``seconds`` (from /proc/stat): other work on the machine
    competes with the benchmark, and this says how much there was."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    share = (idle1 - idle0) / max(1, total1 - total0)
    return round(share * (os.cpu_count() or 1), 2)


def upstream_stats(upstream: Server) -> dict[str, int]:
    with urllib.request.urlopen(upstream.url + "/stats", timeout=5) as r:
        return {k: int(v) for k, v in orjson.loads(r.read()).items()}


def recorder_totals(stderr: str) -> dict[str, int] | None:
    """The ``recorder closed: N written, M dropped`` lines of a proxy's stderr (one per
    worker, and one in all for a single process), summed; None when there is none."""
    lines = _RECORDER_CLOSED.findall(stderr)
    if not lines:
        return None
    return {
        "written": sum(int(w) for w, _ in lines),
        "dropped": sum(int(d) for _, d in lines),
        "recorders": len(lines),
    }


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


def scepsy_command(upstream: Server, store: Path, place: Placement, logs: Path) -> list[str]:
    """The proxy as shipped (default workers); pinned, one worker on its one core."""
    cmd = [sys.executable, "-m", "proxy.cli", "--listen", "127.0.0.1:0"]
    cmd += ["--upstream", f"{MODEL}={upstream.url}", "--store", str(store)]
    cmd += ["--workflow", WORKFLOW, "--log-level", "INFO"]
    if place.server is not None:
        config = logs / "one-worker.yaml"
        config.write_text("proxy:\n  workers: 1\n")
        cmd += ["--config", str(config)]
    return cmd


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
        out["workers"] = _workers(server)
        out["store_check"] = store_check(before, upstream, server, store, code, shutdown_s)
    else:
        out.update(package=peer.package, version=peer.version(), policy=peer.policy)
        out.update(notes=peer.notes, exit_code=code)
    return out


def _workers(server: Server) -> int | None:
    m = re.search(r"\((\d+) workers", server.out.read_text(errors="replace"))
    return int(m[1]) if m else 1 if server.out.stat().st_size else None


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


def print_http(report: dict[str, Any]) -> None:
    phases = [("direct", report["direct"]), *list(report["servers"].items())]
    for name, phase in phases:
        if "skipped" in phase:
            print(f"{name:14} skipped: {phase['skipped'][:200]}")
            continue
        for r in phase["http"]:
            print(
                f"{name:14} c={r['concurrency']:<3} {r['target']:14} {r['rps']:>8.0f} rps"
                f"  p50 {r['p50_ms']:.3f}  p99 {r['p99_ms']:.3f} ms  errors {r['errors']}"
                f"  server cpu {_cpu_ms(r, 'requests')} ms/req  host busy {r['host_busy_pct']}%"
            )
        s = phase["streaming"]
        print(
            f"{name:14} streams x{s['concurrency']:<3} {s['events_per_s']:>10.0f} events/s"
            f"  stream p50 {s['stream_p50_ms']:.2f} ms  errors {s['errors']}"
            f"  host busy {s['host_busy_pct']}%"
        )


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


def _run(runs: list[dict[str, Any]], target: str, c: int) -> dict[str, Any] | None:
    return next((r for r in runs if r["target"] == target and r["concurrency"] == c), None)


def _cpu_ms(run: dict[str, Any] | None, unit: str) -> float | None:
    cpu = None if run is None else run.get("server_cpu_s")
    return None if run is None or cpu is None or not run[unit] else round(cpu * 1e3 / run[unit], 4)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def server_figures(name: str, phase: dict[str, Any]) -> dict[str, Any]:
    """One server's summary figures (see the module docstring)."""
    runs = phase["http"]
    c1, pair = _run(runs, name, 1), _run(runs, "direct", 1)
    c16, c64 = _run(runs, name, 16), _run(runs, name, 64)
    s = phase["streaming"]
    out = {
        "p50_ms_c1": c1 and c1["p50_ms"],
        "direct_p50_ms_c1": pair and pair["p50_ms"],
        "added_p50_ms_c1": c1 and pair and round(c1["p50_ms"] - pair["p50_ms"], 4),
        "rps_c16": c16 and c16["rps"],
        "p99_ms_c16": c16 and c16["p99_ms"],
        "cpu_ms_per_request_c16": _cpu_ms(c16, "requests"),
        "server_cores_c16": c16
        and c16["server_cpu_s"]
        and round(c16["server_cpu_s"] / c16["duration_s"], 3),
        "host_busy_pct_c16": c16 and c16["host_busy_pct"],
        "rps_c64": c64 and c64["rps"],
        "cpu_ms_per_request_c64": _cpu_ms(c64, "requests"),
        "stream_events_per_s": s["events_per_s"],
        "streams_per_s": round(s["streams"] / s["duration_s"], 1),
        "stream_p50_ms": s["stream_p50_ms"],
        "cpu_ms_per_stream": _cpu_ms(s, "streams"),
        "host_busy_pct_streams": s["host_busy_pct"],
        "errors": sum(r["errors"] for r in runs) + s["errors"],
    }
    return out


def summarise(http: dict[str, Any], recorder: dict[str, Any]) -> dict[str, Any]:
    direct = http["direct"]
    servers = {
        name: {"skipped": phase["skipped"]} if "skipped" in phase else server_figures(name, phase)
        for name, phase in http["servers"].items()
    }
    mine = servers[SCEPSY]
    check = http["servers"][SCEPSY].get("store_check", {})
    dropped = recorder["burst"]["dropped"] + recorder["paced"]["dropped"]
    dropped += check.get("proxy_recorder_dropped") or 0
    ratios: dict[str, float | None] = {}
    for peer in PEERS:
        theirs = servers.get(peer.name, {})
        key = peer.name.replace("-", "_")
        ratios[f"rps_c16_over_{key}"] = _ratio(mine.get("rps_c16"), theirs.get("rps_c16"))
        ratios[f"rps_c64_over_{key}"] = _ratio(mine.get("rps_c64"), theirs.get("rps_c64"))
        ratios[f"added_p50_c1_minus_{key}_ms"] = (
            None
            if mine.get("added_p50_ms_c1") is None or theirs.get("added_p50_ms_c1") is None
            else round(mine["added_p50_ms_c1"] - theirs["added_p50_ms_c1"], 4)
        )
        ratios[f"cpu_per_request_c16_over_{key}"] = _ratio(
            mine.get("cpu_ms_per_request_c16"), theirs.get("cpu_ms_per_request_c16")
        )
        ratios[f"stream_events_over_{key}"] = _ratio(
            mine.get("stream_events_per_s"), theirs.get("stream_events_per_s")
        )
    d16 = _run(direct["http"], "direct", 16)
    return {
        "servers": servers,
        "ratios": ratios,
        "direct": {
            "rps_c16": d16 and d16["rps"],
            "stream_events_per_s": direct["streaming"]["events_per_s"],
        },
        # The proxy's own figures under the names issue 2's targets use.
        "added_p50_ms_c1": mine.get("added_p50_ms_c1"),
        "proxied_rps_c16": mine.get("rps_c16"),
        "stream_events_per_s": mine.get("stream_events_per_s"),
        "recorder_records_per_s": recorder["burst"]["records_per_s"],
        "records_dropped": dropped,
        "records_lost": check.get("records_lost"),
    }


def judge(summary: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, t in TARGETS.items():
        value: Any = summary
        for part in t.path:
            value = value.get(part) if isinstance(value, dict) else None
        met: bool | None = None
        if value is not None:
            met = (
                value <= t.bound
                if t.op == "<="
                else value >= t.bound
                if t.op == ">="
                else value == t.bound
            )
        out[key] = {
            "issue": t.issue,
            "figure": ".".join(t.path),
            "target": f"{t.op} {t.bound:g}",
            "value": value,
            "met": None if met is None else bool(met),
        }
    return out


def contention_notes(http: dict[str, Any], place: Placement, client: str) -> list[str]:
    """What a reader must know to weigh this run's figures: who shares the cores, and how
    idle the machine was before each phase (other work competes with every server alike only
    if it was steady)."""
    usable = len(os.sched_getaffinity(0))
    who = f"the load generator ({client}), the stub engine and the loaded server"
    if place.server is None or place.others is None:
        notes = [f"{usable} usable CPUs; {who} share them, unpinned, as shipped"]
    else:
        where = f"server on CPUs {sorted(place.server)}, the others on {sorted(place.others)}"
        notes = [f"{usable} usable CPUs; {who} pinned: {where}"]
    phases = {"direct": http["direct"], **http["servers"]}
    idle = {n: p.get("idle_cpus_before") for n, p in phases.items() if "skipped" not in p}
    busy = {n: v for n, v in idle.items() if v is not None and v < usable - 0.3}
    if busy:
        notes.append(
            "other work was running: idle CPUs before "
            + ", ".join(f"{n} {v:g}" for n, v in busy.items())
            + f" of {usable}; figures of phases with less idle are the less reliable"
        )
    return notes


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
