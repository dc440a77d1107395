"""Load generators for the proxy benchmark: ``wrk`` with a Lua POST script, or an asyncio client.

Role: drive one URL at a fixed concurrency for a fixed time and return requests/s and latency
percentiles as a :class:`LoadResult`; drive Server-Sent Event streams and count the events the
client receives (:class:`StreamResult`). Every generator runs in its own process (``wrk``, or
``python -m bench._load ...``, which prints one JSON line), so it never shares an event loop,
and where the caller pins it never a core, with the proxy.

Invariants:
- only requests that completed inside the measured window count; a warm-up run (same
  connections count, separate process for ``wrk``) precedes each measured one;
- latencies are client-side wall times per request, in milliseconds, over the measured window;
- an error is any non-200 answer or broken exchange; errors are counted, never timed.
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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def wrk_path() -> str | None:
    return shutil.which("wrk")


_WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
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


def run_wrk(
    url: str,
    body: bytes,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    threads: int,
    pin: Cpus = None,
) -> LoadResult:
    """``wrk -c concurrency`` POSTing ``body`` to ``url``; a warm-up run first when asked."""
    exe = wrk_path()
    if exe is None:
        raise RuntimeError("wrk is not on PATH")
    threads = max(1, min(threads, concurrency))
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_WRK_LUA % body.decode())
        script = f.name
    try:

        def once(seconds: float) -> str:
            # wrk takes whole seconds only.
            cmd = [
                exe,
                "-t",
                str(threads),
                "-c",
                str(concurrency),
                "-d",
                f"{max(1, round(seconds))}s",
            ]
            cmd += ["--timeout", "10s", "-s", script, url]
            return _run_child(cmd, pin, seconds + 30)

        if warmup_s > 0:
            once(warmup_s)
        out = once(duration_s)
    finally:
        os.unlink(script)
    line = next((ln for ln in out.splitlines() if ln.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary: {out[-2000:]}")
    s = orjson.loads(line[len("WRK_JSON ") :])
    seconds = s["duration_us"] / 1e6
    errors = int(s["connect"] + s["read"] + s["write"] + s["status"] + s["timeout"])
    return LoadResult(
        client="wrk",
        concurrency=concurrency,
        duration_s=round(seconds, 3),
        requests=int(s["requests"]),
        errors=errors,
        rps=round(s["requests"] / seconds, 1),
        p50_ms=s["p50"] / 1000,
        p90_ms=s["p90"] / 1000,
        p99_ms=s["p99"] / 1000,
        mean_ms=round(s["mean"] / 1000, 4),
        max_ms=s["max"] / 1000,
    )


def run_client(
    url: str,
    body: bytes,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    stream: bool = False,
    pin: Cpus = None,
) -> dict[str, Any]:
    """This module as a child process (the asyncio client); returns its JSON summary."""
    with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
        f.write(body)
        body_file = f.name
    cmd = [sys.executable, "-m", "bench._load", "--url", url, "--body-file", body_file]
    cmd += ["--concurrency", str(concurrency), "--duration", str(duration_s)]
    cmd += ["--warmup", str(warmup_s)] + (["--stream"] if stream else [])
    try:
        out = _run_child(cmd, pin, duration_s + warmup_s + 60)
    finally:
        os.unlink(body_file)
    result: dict[str, Any] = orjson.loads(out.strip().splitlines()[-1])
    return result


def run_aiohttp(
    url: str,
    body: bytes,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    pin: Cpus = None,
) -> LoadResult:
    return LoadResult(**run_client(url, body, concurrency, duration_s, warmup_s, False, pin))


def run_streams(
    url: str,
    body: bytes,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    pin: Cpus = None,
) -> StreamResult:
    return StreamResult(**run_client(url, body, concurrency, duration_s, warmup_s, True, pin))


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


async def _client(args: argparse.Namespace, body: bytes) -> dict[str, Any]:
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(
        connector=conn, headers=headers, auto_decompress=False, skip_auto_headers=("User-Agent",)
    ) as session:
        win = _Window(args.warmup, args.duration)
        if args.stream:
            parts = await asyncio.gather(
                *(_streams(session, args.url, body, win) for _ in range(args.concurrency))
            )
            total = sum(p[0] for p in parts)
            events = [e for p in parts for e in p[1]]
            times = [t for p in parts for t in p[2]]
            p50, _, p99, _, _ = _percentiles(times)
            return StreamResult(
                client="aiohttp",
                concurrency=args.concurrency,
                duration_s=args.duration,
                streams=len(events),
                events=total,
                errors=sum(p[3] for p in parts),
                events_per_s=round(total / args.duration, 1),
                events_per_stream=round(sum(events) / len(events), 2) if events else 0.0,
                stream_p50_ms=p50,
                stream_p99_ms=p99,
            ).as_dict()
        results = await asyncio.gather(
            *(_requests(session, args.url, body, win) for _ in range(args.concurrency))
        )
    lat = [x for r in results for x in r[0]]
    p50, p90, p99, mean, mx = _percentiles(lat)
    return LoadResult(
        client="aiohttp",
        concurrency=args.concurrency,
        duration_s=args.duration,
        requests=len(lat),
        errors=sum(r[1] for r in results),
        rps=round(len(lat) / args.duration, 1),
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        mean_ms=mean,
        max_ms=mx,
    ).as_dict()


def main() -> None:
    p = argparse.ArgumentParser(description="asyncio load client for bench.proxy_overhead")
    p.add_argument("--url", required=True)
    p.add_argument("--body-file", required=True)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--stream", action="store_true")
    args = p.parse_args()
    body = Path(args.body_file).read_bytes()
    print(orjson.dumps(asyncio.run(_client(args, body))).decode(), flush=True)


if __name__ == "__main__":
    main()
