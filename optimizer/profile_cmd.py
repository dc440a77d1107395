"""``scepsy profile``: measure a model's throughput-latency curves by replaying its traced calls.

Role: the effectful edge of :mod:`optimizer.profiler`. For each (TP degree, GPU share) it
obtains an engine from an :class:`EngineSource` (here: emulator processes this command starts
and always stops, on error and Ctrl-C too; or an engine already running at ``--url``), sweeps
it, and stores the points in ``<store>/optimizer.duckdb`` (re-runs replace only the keys they
measure). ``--from-json`` imports points measured elsewhere instead. Prints the points and each
key's saturation throughput; emulated figures say so.

Speed-up: an emulator runs ``speedup`` model seconds per wall second, and every figure is
reported in model time. ``--speedup auto`` (the default for emulators) restarts the emulator
after a closed-loop probe with the speed-up that puts its saturation near ``--wall-rate``
calls per wall second, which this machine's client and emulator can both sustain; the
emulator's own ``/metrics`` (``scepsy_emulator_speedup``) is authoritative when present.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import aiohttp
import duckdb
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table

from optimizer.cli import UsageError
from optimizer.profiler import (
    QUICK,
    PointResult,
    ProfileRunError,
    Replayer,
    SweepResult,
    SweepSettings,
    Target,
    engine_metrics,
    probe,
    sweep,
)
from optimizer.profiles import (
    Profile,
    ProfileError,
    ProfilePoint,
    export_json,
    import_json,
    save_points,
)
from optimizer.replay import ReplayError, Workload, load_workload
from shared.ports import free_port

HELP = "profile a model's throughput-latency curve by replaying its traced calls"
START_TIMEOUT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True, type=Path, help="trace store folder")
    parser.add_argument("--model", required=True, help="model name as recorded")
    parser.add_argument("--tp", default="1", help="TP degrees, comma-separated (1)")
    parser.add_argument("--shares", default="1.0", help="GPU shares, comma-separated (1.0)")
    parser.add_argument("--gpu", default="a6000", help="GPU type (a6000)")
    parser.add_argument("--engine", default="emulator", choices=["emulator"],
                        help="engine source: emulator processes started here")
    parser.add_argument("--url", default=None,
                        help="profile an engine already running at this URL instead (one key: "
                             "the first --tp and --shares value label it)")
    parser.add_argument("--speedup", default="auto",
                        help="model seconds per wall second of the engine, or 'auto' (emulator)")
    parser.add_argument("--wall-rate", type=float, default=100.0,
                        help="--speedup auto aims saturation at this many calls per wall second")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter points")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="import points from this profile file instead of measuring")
    parser.add_argument("--export", type=Path, default=None, help="also write points as JSON")


# ---- engine sources ------------------------------------------------------------------------

class EngineSource(Protocol):
    """Where engines to profile come from: started for one key, stopped on exit."""

    @property
    def engine(self) -> str: ...

    def serve(self, model: str, tp: int, share: float,
              speedup: float) -> contextlib.AbstractAsyncContextManager[Target]: ...




async def _wait_healthy(url: str, proc: asyncio.subprocess.Process | None,
                        timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            if proc is not None and proc.returncode is not None:
                raise ProfileRunError(f"the engine exited with status {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url + "/health",
                                       timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise ProfileRunError(f"the engine at {url} did not become healthy in {timeout_s:g}s")


async def _reported_speedup(url: str, asked: float) -> float:
    async with aiohttp.ClientSession() as session:
        return (await engine_metrics(session, url)).get("scepsy_emulator_speedup", asked)


@dataclass(frozen=True)
class EmulatorProcesses:
    """Emulator processes (``python -m sim.cli``) on free loopback ports."""

    gpu: str
    python: str = sys.executable
    engine: str = "emulator"

    @contextlib.asynccontextmanager
    async def serve(self, model: str, tp: int, share: float,
                    speedup: float) -> AsyncIterator[Target]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with tempfile.TemporaryFile() as log:
            proc = await asyncio.create_subprocess_exec(
                self.python, "-m", "sim.cli", "--model", model, "--gpu", self.gpu,
                "--tp", str(tp), "--share", str(share), "--port", str(port),
                "--speedup", repr(speedup), stdout=log, stderr=log)
            try:
                try:
                    await _wait_healthy(url, proc, START_TIMEOUT_S)
                except ProfileRunError as exc:
                    log.seek(0)
                    tail = log.read()[-600:].decode("utf-8", "replace").strip()
                    raise ProfileRunError(f"emulator for {model} (tp={tp}, share={share}): "
                                          f"{exc}: {tail}") from None
                yield Target(url, model, self.engine, self.gpu, tp, share,
                             await _reported_speedup(url, speedup))
            finally:
                await _stop(proc)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@dataclass(frozen=True)
class RunningEngine:
    """An engine someone else runs (any OpenAI-compatible server)."""

    url: str
    gpu: str
    engine: str = "external"

    @contextlib.asynccontextmanager
    async def serve(self, model: str, tp: int, share: float,
                    speedup: float) -> AsyncIterator[Target]:
        url = self.url.rstrip("/").removesuffix("/v1")
        await _wait_healthy(url, None, 10.0)
        yield Target(url, model, self.engine, self.gpu, tp, share,
                     await _reported_speedup(url, speedup))


# ---- speed-up ------------------------------------------------------------------------------

async def choose_speedup(source: EngineSource, workload: Workload, tp: int, share: float,
                         wall_rate: float, settings: SweepSettings) -> float:
    """The speed-up that puts saturation near ``wall_rate`` calls per wall second: probe,
    correct for an engine the client could not keep busy (its busy-time counter), retry."""
    speedup = 1.0
    for _ in range(4):
        async with source.serve(workload.model, tp, share, speedup) as target:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                rep = Replayer(s, target, workload, settings.call_timeout_s)
                before = await engine_metrics(s, target.url)
                t0 = asyncio.get_running_loop().time()
                try:
                    rate = await probe(rep, replace(settings, probe_max_s=2.0))
                except ProfileRunError as exc:
                    if "too slow" not in str(exc):
                        raise
                    speedup = target.speedup * 8.0  # too few calls finished: run faster
                    continue
                wall = asyncio.get_running_loop().time() - t0
                after = await engine_metrics(s, target.url)
        busy = "scepsy_emulator_model_busy_seconds_total"
        util = 1.0
        if busy in before and busy in after:
            util = min(1.0, max(0.02, (after[busy] - before[busy]) / (wall * target.speedup)))
        capacity_wall = rate * target.speedup / util
        if 0.6 * wall_rate <= capacity_wall <= 1.6 * wall_rate and util > 0.5:
            break
        speedup = float(f"{target.speedup * wall_rate / capacity_wall:.2g}")
    return speedup


# ---- presentation --------------------------------------------------------------------------

class RichProgress:
    """A bar per sweep point (its wall time), then one line with the point's figures."""

    def __init__(self, console: Console, label: str) -> None:
        self.console = console
        self.label = label
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                            TimeRemainingColumn(), console=console, transient=True,
                            disable=not console.is_terminal)
        self.task: TaskID | None = None
        self.ticker: asyncio.Task[None] | None = None

    def point_started(self, index: int, rate: float, duration_s: float) -> None:
        self.bar.start()
        self.task = self.bar.add_task(f"{self.label} point {index + 1} @ {rate:.3g} calls/s",
                                      total=duration_s)
        self.ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while self.task is not None:
            self.bar.advance(self.task, 0.1)
            await asyncio.sleep(0.1)

    def point_finished(self, index: int, result: PointResult) -> None:
        if self.ticker is not None:
            self.ticker.cancel()
        if self.task is not None:
            self.bar.remove_task(self.task)
            self.task = None
        self.bar.stop()
        p = result.point
        note = f"  saturated: {result.saturated}" if result.saturated else ""
        self.console.print(f"  {self.label} offered {result.nominal_rate:.3g}/s -> "
                           f"{p.throughput:.3g}/s, p50 {p.lat_p50:.3g}s{note}")


def points_table(points: Sequence[ProfilePoint], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("tp", "share", "offered/s", "throughput/s", "mean s", "p50 s", "p90 s",
                "p99 s", "ttft s", "calls"):
        table.add_column(col, justify="right", no_wrap=True)
    for p in sorted(points, key=lambda p: (p.tp, p.share, p.offered_rate)):
        table.add_row(str(p.tp), f"{p.share:g}", f"{p.offered_rate:.3g}", f"{p.throughput:.3g}",
                      f"{p.lat_mean:.3g}", f"{p.lat_p50:.3g}", f"{p.lat_p90:.3g}",
                      f"{p.lat_p99:.3g}", f"{p.ttft_mean:.3g}", str(p.n_calls))
    return table


def saturation_lines(points: Sequence[ProfilePoint]) -> list[str]:
    by_key: dict[tuple[int, float], list[ProfilePoint]] = {}
    for p in points:
        by_key.setdefault((p.tp, p.share), []).append(p)
    lines = []
    for (tp, share), pts in sorted(by_key.items()):
        prof = Profile.from_points(pts)
        bound = "" if prof.saturated else " (not reached: a lower bound)"
        lines.append(f"tp={tp} share={share:g}: saturation {prof.saturation:.4g} calls/s{bound}")
    return lines


# ---- the command ---------------------------------------------------------------------------

def _numbers(text: str, kind: type[int] | type[float], flag: str) -> list[float]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise UsageError(f"{flag}: expected comma-separated numbers, got {text!r}") from exc
    if not values:
        raise UsageError(f"{flag}: give at least one value")
    return [float(v) for v in values]


async def _measure(args: argparse.Namespace, workload: Workload, console: Console,
                   settings: SweepSettings) -> list[ProfilePoint]:
    tps = [int(v) for v in _numbers(args.tp, int, "--tp")]
    shares = _numbers(args.shares, float, "--shares")
    if any(t < 1 or t & (t - 1) for t in tps) or any(not 0 < s <= 1 for s in shares):
        raise UsageError("--tp values must be powers of two, --shares in (0, 1]")
    source: RunningEngine | EmulatorProcesses = (RunningEngine(args.url, args.gpu) if args.url
                                                 else EmulatorProcesses(args.gpu))
    keys = [(tps[0], shares[0])] if args.url else [(t, s) for t in tps for s in shares]
    label = "emulated" if isinstance(source, EmulatorProcesses) else "measured"
    points: list[ProfilePoint] = []
    for tp, share in keys:
        if args.speedup == "auto":
            speedup = (1.0 if args.url else await choose_speedup(
                source, workload, tp, share, args.wall_rate, settings))
        else:
            speedup = float(args.speedup)
            if not math.isfinite(speedup) or speedup <= 0:
                raise UsageError("--speedup must be a positive number or 'auto'")
        tag = f"{workload.model} tp={tp} share={share:g} ({label}, speedup {speedup:g})"
        async with source.serve(workload.model, tp, share, speedup) as target:
            result: SweepResult = await sweep(target, workload, settings,
                                              RichProgress(console, tag))
        lagging = [r.clock_lag for r in result.points
                   if r.clock_lag is not None and r.clock_lag > 0.05]
        if lagging:
            console.print(f"[yellow]{tag}: the emulator's clock lagged up to "
                          f"{max(lagging):.0%}: figures are pessimistic; lower --speedup")
        mine = [r.point for r in result.points]
        save_points(args.store, mine)
        points.extend(mine)
    return points


def run(args: argparse.Namespace) -> int:
    console = Console(width=None if Console().is_terminal else 120)
    try:
        if args.from_json is not None:
            try:
                points = import_json(args.from_json.read_bytes())
            except OSError as exc:
                raise UsageError(f"cannot read {args.from_json}: {exc}") from exc
            except ProfileError as exc:
                raise UsageError(f"{args.from_json}: {exc}") from exc
            points = [p for p in points if p.model == args.model]
            if not points:
                raise UsageError(f"{args.from_json} holds no points of model {args.model!r}")
            save_points(args.store, points)
            title = f"profile of {args.model} (imported from {args.from_json})"
        else:
            try:
                workload = load_workload(args.store, args.model)
            except ReplayError as exc:
                raise UsageError(str(exc)) from exc
            except duckdb.Error as exc:
                raise UsageError(f"cannot read the store at {args.store}: {exc}") from exc
            console.print(f"{len(workload.calls)} calls of {args.model} in "
                          f"{len(workload.groups)} requests to replay"
                          + (f" ({workload.skipped} failed or without body skipped)"
                             if workload.skipped else ""))
            settings = QUICK if args.quick else SweepSettings()
            points = asyncio.run(_measure(args, workload, console, settings))
            engine = "emulated" if args.url is None else "measured"
            title = f"profile of {args.model} ({engine}, model time)"
    except ProfileRunError as exc:
        print(f"scepsy profile: {exc}", file=sys.stderr)
        return 1
    console.print(points_table(points, title))
    for line in saturation_lines(points):
        console.print(line)
    if args.export is not None:
        args.export.write_bytes(export_json(points))
    return 0
