"""Load generators for the proxy benchmark: ``wrk`` with a Lua POST script, or an asyncio client.

Role: drive one URL at a fixed concurrency for a fixed time and return requests/s and latency
percentiles as a :class:`LoadResult`; drive Server-Sent Event streams and count the events the
client receives (:class:`StreamResult`). Every generator runs in its own process (``wrk``, or
``python -m bench.proxy._load ...``, which prints one JSON line), so it never shares an event loop,
and where the caller pins it never a core, with the proxy.

Invariants:
- only requests that completed inside the measured window count; a warm-up run (same
  connections count, separate process for ``wrk``) precedes each measured one;
- latencies are client-side wall times per request, in milliseconds, over the measured window;
- an error is any non-200 answer or broken exchange; errors are counted, never timed;
- a job's ``cpu_pid`` names a server; its CPU time is summed over that process and every
  descendant (a supervisor and its workers), alive or reaped, and the host's busy share is
  sampled over the same window.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

Cpus = frozenset[int] | None  # the cores a child process is pinned to (None: not pinned)


def popen(cmd: list[str], cpus: Cpus, **kw: Any) -> subprocess.Popen[Any]:
    """Start ``cmd`` pinned to ``cpus`` from before it runs (threads it starts inherit that)."""
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    return subprocess.Popen(cmd, preexec_fn=pin, **kw)


@dataclass(frozen=True)
class LoadResult:
    client: str
    concurrency: int
    duration_s: float
    requests: int
    errors: int
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    server_cpu_s: float | None = None  # CPU time of the watched server's tree over the window
    host_busy_pct: float | None = None  # share of all the host's CPUs busy over the window

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StreamResult:
    client: str
    concurrency: int
    duration_s: float
    streams: int
    events: int
    errors: int
    events_per_s: float
    events_per_stream: float
    stream_p50_ms: float
    stream_p99_ms: float
    server_cpu_s: float | None = None
    host_busy_pct: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Job:
    """One load run: POST ``body`` to ``url`` from ``concurrency`` connections, warm up, then
    measure for ``duration_s``. ``headers`` are extra request headers."""

    url: str
    body: str
    concurrency: int
    duration_s: float
    warmup_s: float
    stream: bool = False
    headers: tuple[tuple[str, str], ...] = ()
    cpu_pid: int | None = None  # a process whose tree's CPU time over the window is reported

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after ``pid (comm) ``: state, ppid, ... (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it now (from each process's ppid in /proc),
    parents before children; empty when ``root`` is gone."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    if _stat_fields(root) is None:
        return []
    tree = [root]
    for pid in tree:  # grows while walked: breadth first
        tree.extend(children.get(pid, ()))
    return tree


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds so far of process ``pid`` and all its descendants (every
    thread), including descendants that have exited and been reaped (their parent's
    cutime/cstime), from /proc. None when ``pid`` is not running."""
    if pid is None:
        return None
    ticks = 0
    found = False
    for member in process_tree(pid):
        fields = _stat_fields(member)
        if fields is None:  # exited between the scan and now
            continue
        found = True
        ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / _TICK if found else None


def host_ticks() -> tuple[int, int] | None:
    """(busy, total) CPU ticks of the whole host so far, from the first line of /proc/stat;
    iowait counts as idle."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    total = sum(fields[:8])  # guest time is already inside user/nice
    return total - fields[3] - fields[4], total


def busy_pct(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Share (%) of the host's CPU time that was busy between two :func:`host_ticks`."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round(100 * (after[0] - before[0]) / (after[1] - before[1]), 1)


def _cpu_delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round(after - before, 3)


def wrk_path() -> str | None:
    return shutil.which("wrk")


_WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
%s
wrk.body = [==[%s]==]
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK_JSON {\\"requests\\": %%.0f, \\"duration_us\\": %%.0f, \\"connect\\": %%.0f, " ..
    "\\"read\\": %%.0f, \\"write\\": %%.0f, \\"status\\": %%.0f, \\"timeout\\": %%.0f, " ..
    "\\"p50\\": %%.1f, \\"p90\\": %%.1f, \\"p99\\": %%.1f, \\"mean\\": %%.3f, \\"max\\": %%.1f}\\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.mean, latency.max))
end
"""


def _run_child(cmd: list[str], pin: Cpus, timeout_s: float) -> str:
    proc = popen(cmd, pin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"load generator timed out: {' '.join(cmd)}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed ({proc.returncode}): {err.strip()[-2000:]}")
    return str(out)


def run_wrk(job: Job, threads: int, pin: Cpus = None) -> LoadResult:
    """``wrk`` for one non-streaming job; its warm-up is a separate ``wrk`` run first.
    ``wrk`` takes whole seconds: durations are rounded (at least 1 s)."""
    exe = wrk_path()
    if exe is None:
        raise RuntimeError("wrk is not on PATH")
    threads = max(1, min(threads, job.concurrency))
    headers = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in job.headers)
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_WRK_LUA % (headers, job.body))
        script = f.name
    try:

        def once(seconds: float) -> str:
            cmd = [exe, "-t", str(threads), "-c", str(job.concurrency)]
            cmd += ["-d", f"{max(1, round(seconds))}s", "--timeout", "10s", "-s", script, job.url]
            return _run_child(cmd, pin, seconds + 30)

        if job.warmup_s > 0:
            once(job.warmup_s)
        cpu0, host0 = cpu_seconds(job.cpu_pid), host_ticks()
        out = once(job.duration_s)
        cpu = _cpu_delta(cpu0, cpu_seconds(job.cpu_pid))
        busy = busy_pct(host0, host_ticks())
    finally:
        os.unlink(script)
    line = next((ln for ln in out.splitlines() if ln.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary: {out[-2000:]}")
    s = orjson.loads(line[len("WRK_JSON ") :])
    seconds = s["duration_us"] / 1e6
    return LoadResult(
        client="wrk",
        concurrency=job.concurrency,
        duration_s=round(seconds, 3),
        requests=int(s["requests"]),
        errors=int(s["connect"] + s["read"] + s["write"] + s["status"] + s["timeout"]),
        rps=round(s["requests"] / seconds, 1),
        p50_ms=s["p50"] / 1000,
        p90_ms=s["p90"] / 1000,
        p99_ms=s["p99"] / 1000,
        mean_ms=round(s["mean"] / 1000, 4),
        max_ms=s["max"] / 1000,
        server_cpu_s=cpu,
        host_busy_pct=busy,
    )


def run_client(jobs: list[Job], pin: Cpus = None) -> list[LoadResult | StreamResult]:
    """The asyncio client: one child process (``python -m bench.proxy._load``) runs ``jobs`` one
    after the other, so its start-up is paid once."""
    with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
        f.write(orjson.dumps([j.as_dict() for j in jobs]))
        jobs_file = f.name
    budget = sum(j.duration_s + j.warmup_s for j in jobs) + 60
    try:
        out = _run_child([sys.executable, "-m", "bench.proxy._load", jobs_file], pin, budget)
    finally:
        os.unlink(jobs_file)
    results = orjson.loads(out.strip().splitlines()[-1])
    return [
        StreamResult(**r) if j.stream else LoadResult(**r)
        for j, r in zip(jobs, results, strict=True)
    ]


# --- the asyncio client (runs in the child process) -----------------------------------------


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) on sorted data."""
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _percentiles(samples_ns: list[int]) -> tuple[float, float, float, float, float]:
    """(p50, p90, p99, mean, max) in milliseconds; no numpy, so the client starts fast."""
    if not samples_ns:
        return (0.0, 0.0, 0.0, 0.0, 0.0)
    ms = sorted(x / 1e6 for x in samples_ns)
    out = (*(_quantile(ms, q) for q in (0.5, 0.9, 0.99)), sum(ms) / len(ms), ms[-1])
    p50, p90, p99, mean, mx = (round(x, 4) for x in out)
    return p50, p90, p99, mean, mx


class _Window:
    """The measured window: starts after warm-up; requests finishing inside it count."""

    def __init__(self, warmup_s: float, duration_s: float) -> None:
        now = time.perf_counter_ns()
        self.start = now + int(warmup_s * 1e9)
        self.end = self.start + int(duration_s * 1e9)

    def counts(self, t0: int, t1: int) -> bool:
        return t0 >= self.start and t1 <= self.end


async def _requests(
    session: aiohttp.ClientSession, url: str, body: bytes, win: _Window
) -> tuple[list[int], int]:
    lat: list[int] = []
    errors = 0
    while True:
        t0 = time.perf_counter_ns()
        if t0 >= win.end:
            return lat, errors
        try:
            async with session.post(url, data=body) as r:
                await r.read()
                ok = r.status == 200
        except aiohttp.ClientError:
            ok = False
        t1 = time.perf_counter_ns()
        if win.counts(t0, t1):
            if ok:
                lat.append(t1 - t0)
            else:
                errors += 1


async def _streams(
    session: aiohttp.ClientSession, url: str, body: bytes, win: _Window
) -> tuple[int, list[int], list[int], int]:
    """Streams back to back. Returns (events received inside the window, events of each
    stream that ran wholly inside it, those streams' times, failed streams)."""
    in_window = 0
    events: list[int] = []
    times: list[int] = []
    errors = 0
    while True:
        t0 = time.perf_counter_ns()
        if t0 >= win.end:
            return in_window, events, times, errors
        n = 0
        ok = True
        try:
            async with session.post(url, data=body) as r:
                ok = r.status == 200
                last = b""
                async for chunk in r.content.iter_any():
                    # An event ends with a blank line; count boundaries split across reads too.
                    k = chunk.count(b"\n\n") + (last == b"\n" and chunk[:1] == b"\n")
                    last = chunk[-1:]
                    n += k
                    if win.start <= time.perf_counter_ns() <= win.end:
                        in_window += k
        except aiohttp.ClientError:
            ok = False
        t1 = time.perf_counter_ns()
        if win.counts(t0, t1):
            if ok:
                events.append(n)
                times.append(t1 - t0)
            else:
                errors += 1


async def _cpu_over(win: _Window, pid: int | None) -> tuple[float | None, float | None]:
    """(CPU seconds ``pid``'s tree used, host busy %) between the window's start and end
    (sampled at both)."""
    await asyncio.sleep(max(0.0, (win.start - time.perf_counter_ns()) / 1e9))
    before, host0 = cpu_seconds(pid), host_ticks()
    await asyncio.sleep(max(0.0, (win.end - time.perf_counter_ns()) / 1e9))
    return _cpu_delta(before, cpu_seconds(pid)), busy_pct(host0, host_ticks())


async def _run_job(session: aiohttp.ClientSession, job: Job) -> dict[str, Any]:
    body = job.body.encode()
    win = _Window(job.warmup_s, job.duration_s)
    c = job.concurrency
    cpu_task = asyncio.create_task(_cpu_over(win, job.cpu_pid))
    if job.stream:
        parts = await asyncio.gather(*(_streams(session, job.url, body, win) for _ in range(c)))
        total = sum(p[0] for p in parts)
        events = [e for p in parts for e in p[1]]
        times = [t for p in parts for t in p[2]]
        p50, _, p99, _, _ = _percentiles(times)
        cpu, busy = await cpu_task
        return StreamResult(
            client="aiohttp",
            concurrency=c,
            duration_s=job.duration_s,
            streams=len(events),
            events=total,
            errors=sum(p[3] for p in parts),
            events_per_s=round(total / job.duration_s, 1),
            events_per_stream=round(sum(events) / len(events), 2) if events else 0.0,
            stream_p50_ms=p50,
            stream_p99_ms=p99,
            server_cpu_s=cpu,
            host_busy_pct=busy,
        ).as_dict()
    results = await asyncio.gather(*(_requests(session, job.url, body, win) for _ in range(c)))
    lat = [x for r in results for x in r[0]]
    p50, p90, p99, mean, mx = _percentiles(lat)
    cpu, busy = await cpu_task
    return LoadResult(
        client="aiohttp",
        concurrency=c,
        duration_s=job.duration_s,
        requests=len(lat),
        errors=sum(r[1] for r in results),
        rps=round(len(lat) / job.duration_s, 1),
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        mean_ms=mean,
        max_ms=mx,
        server_cpu_s=cpu,
        host_busy_pct=busy,
    ).as_dict()


async def _client(jobs: list[Job]) -> list[dict[str, Any]]:
    out = []
    for job in jobs:
        # A fresh session per job: its connections are the job's own, as with wrk.
        headers = {"Content-Type": "application/json", **dict(job.headers)}
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            headers=headers,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        ) as session:
            out.append(await _run_job(session, job))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="asyncio load client for bench.proxy.overhead")
    p.add_argument("jobs_file", help="JSON list of jobs (bench.proxy._load.Job fields)")
    args = p.parse_args()
    raw = orjson.loads(Path(args.jobs_file).read_bytes())
    jobs = [Job(**{**j, "headers": tuple(map(tuple, j["headers"]))}) for j in raw]
    print(orjson.dumps(asyncio.run(_client(jobs))).decode(), flush=True)


if __name__ == "__main__":
    main()
