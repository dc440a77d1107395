"""``scepsy profile``: measure a model's throughput-latency curves by replaying its traced calls.

Role: the effectful edge of :mod:`optimizer.profiling.profiler`. For each (TP degree, GPU share) it
obtains an engine from an :class:`EngineSource` (here: emulator processes this command starts
and always stops, on error and Ctrl-C too; or an engine already running at ``--url``), sweeps
it, and stores the points in ``<store>/optimizer.duckdb`` (re-runs replace only the keys they
measure). ``--from-json`` imports points measured elsewhere instead. Prints the points and each
key's saturation throughput; emulated figures say so.

Speed-up: an emulator runs ``speedup`` model seconds per wall second, and every figure is
reported in model time. ``--speedup auto`` (the default for emulators) probes the emulator
closed-loop, measures what one call costs in CPU on each side (this process, and the emulator
process it started), and restarts the emulator at the speed-up that puts its saturation at
the wall rate where neither side spends more than ``--cpu-budget`` of a core: an emulator
short of CPU runs its clock late and reads pessimistic (each point reports that lag, from the
emulator's own ``/metrics``). The run whose probe confirms the speed-up is the one swept, and
its probe is the sweep's capacity estimate. ``--wall-rate`` sets that wall rate instead.

Trust: each point's prefix-hit rate (where the engine reports cached tokens) is held against
the trace's (``--hit-rate-tolerance``, :data:`optimizer.profiling.window.HIT_RATE_TOLERANCE`
by default). A point past it measured a cache the workload did not have: it is printed as
untrusted, not stored, and ``--export`` writes it under ``"untrusted"`` with both rates and the
reason (``"points"`` holds what was stored, so the file still imports).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp
import duckdb
import orjson
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table

from optimizer.cli.main import UsageError, existing_store
from optimizer.model.curves import Profile
from optimizer.profiling import profiler, replay, window
from optimizer.profiling.auto import Untrusted, trusted_points
from optimizer.profiling.profiler import PointResult, ProfileRunError, Replayer, SweepResult
from optimizer.profiling.replay import ReplayError, Workload
from optimizer.profiling.window import QUICK, SweepSettings, Target
from optimizer.store import profiles
from shared.ports import free_port
from shared.profile_points import ProfileError, ProfilePoint, export_json, import_json

START_TIMEOUT_S = 60.0
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True, type=Path, help="trace store folder")
    parser.add_argument("--model", required=True, help="model name as recorded")
    parser.add_argument("--tp", default="1", help="TP degrees, comma-separated (1)")
    parser.add_argument("--shares", default="1.0", help="GPU shares, comma-separated (1.0)")
    parser.add_argument("--gpu", default="a6000", help="GPU type (a6000)")
    parser.add_argument(
        "--engine",
        default="emulator",
        choices=["emulator"],
        help="engine source: emulator processes started here",
    )
    parser.add_argument(
        "--url",
        default=None,
        help="profile an engine already running at this URL instead (one key: "
        "the first --tp and --shares value label it)",
    )
    parser.add_argument(
        "--speedup",
        default="auto",
        help="model seconds per wall second of the engine, or 'auto' (emulator)",
    )
    parser.add_argument(
        "--cpu-budget",
        type=float,
        default=0.3,
        help="--speedup auto: the share of one core the client or an emulator "
        "may spend at saturation (0.3)",
    )
    parser.add_argument(
        "--wall-rate",
        type=float,
        default=None,
        help="--speedup auto aims saturation at this many calls per wall second "
        "(default: from --cpu-budget and the measured cost of a call)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer, shorter points")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="import points from this profile file instead of measuring",
    )
    parser.add_argument("--export", type=Path, default=None, help="also write points as JSON")
    parser.add_argument(
        "--hit-rate-tolerance",
        type=float,
        default=window.HIT_RATE_TOLERANCE,
        help="a point whose prefix-hit rate departs from the trace's by more than this "
        f"(absolute) is not stored ({window.HIT_RATE_TOLERANCE:g}; 1 keeps every point)",
    )


# ---- engine sources ------------------------------------------------------------------------


class EngineSource(Protocol):
    """Where engines to profile come from: started for one key, stopped on exit."""

    @property
    def engine(self) -> str: ...

    def serve(
        self, model: str, tp: int, share: float, speedup: float
    ) -> contextlib.AbstractAsyncContextManager[Target]: ...

    def cpu_seconds(self, target: Target) -> float | None:
        """CPU time the engine serving ``target`` has used, if this machine can tell."""


async def _wait_healthy(
    url: str, proc: asyncio.subprocess.Process | None, timeout_s: float
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            if proc is not None and proc.returncode is not None:
                raise ProfileRunError(f"the engine exited with status {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(
                    url + "/health", timeout=aiohttp.ClientTimeout(total=2)
                ) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise ProfileRunError(f"the engine at {url} did not become healthy in {timeout_s:g}s")


async def _reported_speedup(url: str, asked: float) -> float:
    async with aiohttp.ClientSession() as session:
        return (await profiler.engine_metrics(session, url)).get("scepsy_emulator_speedup", asked)


@dataclass(frozen=True)
class EmulatorProcesses:
    """Emulator processes (``python -m sim.cli``) on free loopback ports."""

    gpu: str
    python: str = sys.executable
    engine: str = "emulator"
    pids: dict[str, int] = field(default_factory=dict)  # url -> pid of the running ones

    @contextlib.asynccontextmanager
    async def serve(
        self, model: str, tp: int, share: float, speedup: float
    ) -> AsyncIterator[Target]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with tempfile.TemporaryFile() as log:
            proc = await asyncio.create_subprocess_exec(
                self.python,
                "-m",
                "sim.cli",
                "--model",
                model,
                "--gpu",
                self.gpu,
                "--tp",
                str(tp),
                "--share",
                str(share),
                "--port",
                str(port),
                "--speedup",
                repr(speedup),
                stdout=log,
                stderr=log,
            )
            try:
                try:
                    await _wait_healthy(url, proc, START_TIMEOUT_S)
                except ProfileRunError as exc:
                    log.seek(0)
                    tail = log.read()[-600:].decode("utf-8", "replace").strip()
                    raise ProfileRunError(
                        f"emulator for {model} (tp={tp}, share={share}): {exc}: {tail}"
                    ) from None
                self.pids[url] = proc.pid
                yield Target(
                    url,
                    model,
                    self.engine,
                    self.gpu,
                    tp,
                    share,
                    await _reported_speedup(url, speedup),
                )
            finally:
                self.pids.pop(url, None)
                await _stop(proc)

    def cpu_seconds(self, target: Target) -> float | None:
        """User + system CPU of the emulator process (Linux ``/proc``; else None)."""
        pid = self.pids.get(target.url)
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields_ = f.read().rpartition(")")[2].split()
        except (OSError, TypeError):
            return None
        return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


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
    async def serve(
        self, model: str, tp: int, share: float, speedup: float
    ) -> AsyncIterator[Target]:
        url = self.url.rstrip("/").removesuffix("/v1")
        await _wait_healthy(url, None, 10.0)
        yield Target(
            url, model, self.engine, self.gpu, tp, share, await _reported_speedup(url, speedup)
        )

    def cpu_seconds(self, target: Target) -> float | None:
        return None


# ---- speed-up ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """One closed-loop probe of an emulator: what the speed-up choice rests on."""

    speedup: float
    estimate: float  # model calls/s completed (the sweep's capacity estimate)
    util: float  # share of the probe's wall time the engine spent stepping (1: saturated)
    client_cpu_s: float  # per call sent, this process
    engine_cpu_s: float | None  # per call sent, the emulator process (None: unknown)
    lag: float | None  # the emulator's clock lag over the probe

    def wanted_speedup(self, cpu_budget: float, wall_rate: float | None) -> float:
        """The speed-up putting saturation at ``wall_rate`` calls per wall second, or where
        the costlier side spends ``cpu_budget`` of a core; two significant digits."""
        per_call = max(self.client_cpu_s, self.engine_cpu_s or 0.0, 1e-6)
        rate = wall_rate if wall_rate is not None else cpu_budget / per_call
        return float(f"{rate / self.capacity:.2g}")

    @property
    def capacity(self) -> float:
        """Model calls/s of the engine kept busy: the probe's rate over the share of wall
        time the engine spent in model steps (busy time counts the model's own step
        durations, so a client that left it idle and an emulator whose clock lagged both
        read low by that share)."""
        return self.estimate / self.util


async def calibrate(
    source: EngineSource, target: Target, workload: Workload, settings: SweepSettings
) -> Calibration:
    """Probe ``target`` closed-loop, measuring CPU per call on both sides and the engine's
    busy time (a client that cannot keep the engine busy reads low: ``util`` corrects it)."""
    busy = "scepsy_emulator_model_busy_seconds_total"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        rep = Replayer(s, target, workload, settings.call_timeout_s)
        loop = asyncio.get_running_loop()
        before = await profiler.engine_metrics(s, target.url)
        t0, cpu0, ecpu0 = loop.time(), time.process_time(), source.cpu_seconds(target)
        ends, stop = await profiler.probe_ends(rep, settings)
        n = max(1, rep.sent)  # most of a call's cost falls when it is sent (parse, plan)
        wall = loop.time() - t0
        cpu, ecpu1 = time.process_time() - cpu0, source.cpu_seconds(target)
        after = await profiler.engine_metrics(s, target.url)
    util = 1.0
    if busy in before and busy in after:
        util = min(1.0, max(0.02, (after[busy] - before[busy]) / (wall * target.speedup)))
    return Calibration(
        target.speedup,
        profiler.capacity_estimate(ends, stop, settings, target.speedup),
        util,
        cpu / n,
        None if ecpu0 is None or ecpu1 is None else (ecpu1 - ecpu0) / n,
        window.clock_lag(before, after, wall),
    )


@contextlib.asynccontextmanager
async def calibrated(
    source: EngineSource,
    workload: Workload,
    tp: int,
    share: float,
    settings: SweepSettings,
    cpu_budget: float,
    wall_rate: float | None,
) -> AsyncIterator[tuple[Target, Calibration]]:
    """A running emulator at the speed-up its own probe confirms (module docstring): start at
    1, probe, restart at the wanted speed-up until a probe wants (about) the one it ran at."""
    speedup = 1.0
    for attempt in range(4):
        async with source.serve(workload.model, tp, share, speedup) as target:
            try:
                cal = await calibrate(source, target, workload, settings)
            except ProfileRunError as exc:
                if "too slow" not in str(exc) or attempt == 3:
                    raise
                speedup = target.speedup * 8.0  # too few calls finished: run faster
                continue
            wanted = cal.wanted_speedup(cpu_budget, wall_rate)
            # the probe's lag is not a reason to slow down: 256 calls in flight load the
            # emulator more than any sweep point, and each point reports its own lag
            if attempt == 3 or (cal.util > 0.5 and 0.7 <= wanted / target.speedup <= 1.4):
                yield target, cal
                return
        speedup = wanted
    raise AssertionError("unreachable: the last attempt yields or raises")


# ---- presentation --------------------------------------------------------------------------


class RichProgress:
    """A bar per sweep point (its wall time), then one line with the point's figures."""

    def __init__(self, console: Console, label: str) -> None:
        self.console = console
        self.label = label
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )
        self.task: TaskID | None = None
        self.ticker: asyncio.Task[None] | None = None

    def point_started(self, index: int, rate: float, duration_s: float) -> None:
        self.bar.start()
        self.task = self.bar.add_task(
            f"{self.label} point {index + 1} @ {rate:.3g} calls/s", total=duration_s
        )
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
        lag = "" if result.clock_lag is None else f", clock lag {result.clock_lag:.1%}"
        if result.hit_rate is not None:
            lag += f", prefix hits {result.hit_rate:.0%}"
        self.console.print(
            f"  {self.label} offered {result.nominal_rate:.3g}/s (sent "
            f"{p.offered_rate:.3g}) -> {p.throughput:.3g}/s, p50 "
            f"{p.lat_p50:.3g}s{lag}{note}"
        )


def points_table(points: Sequence[ProfilePoint], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in (
        "tp",
        "share",
        "offered/s",
        "throughput/s",
        "mean s",
        "p50 s",
        "p90 s",
        "p99 s",
        "ttft s",
        "calls",
    ):
        table.add_column(col, justify="right", no_wrap=True)
    for p in sorted(points, key=lambda p: (p.tp, p.share, p.offered_rate)):
        table.add_row(
            str(p.tp),
            f"{p.share:g}",
            f"{p.offered_rate:.3g}",
            f"{p.throughput:.3g}",
            f"{p.lat_mean:.3g}",
            f"{p.lat_p50:.3g}",
            f"{p.lat_p90:.3g}",
            f"{p.lat_p99:.3g}",
            f"{p.ttft_mean:.3g}",
            str(p.n_calls),
        )
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


def export_document(points: Sequence[ProfilePoint], untrusted: Sequence[Untrusted]) -> bytes:
    """``--export``'s file: the stored points (importable), and the untrusted ones apart."""
    doc = orjson.loads(export_json(points))
    doc["untrusted"] = [u.to_json() for u in untrusted]
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2)


async def _measure(
    args: argparse.Namespace,
    workload: Workload,
    console: Console,
    settings: SweepSettings,
    untrusted: list[Untrusted],
) -> list[ProfilePoint]:
    tps = [int(v) for v in _numbers(args.tp, int, "--tp")]
    shares = _numbers(args.shares, float, "--shares")
    if any(t < 1 or t & (t - 1) for t in tps) or any(not 0 < s <= 1 for s in shares):
        raise UsageError("--tp values must be powers of two, --shares in (0, 1]")
    source: RunningEngine | EmulatorProcesses = (
        RunningEngine(args.url, args.gpu) if args.url else EmulatorProcesses(args.gpu)
    )
    keys = [(tps[0], shares[0])] if args.url else [(t, s) for t in tps for s in shares]
    label = "emulated" if isinstance(source, EmulatorProcesses) else "measured"
    if args.speedup != "auto":
        fixed = float(args.speedup)
        if not math.isfinite(fixed) or fixed <= 0:
            raise UsageError("--speedup must be a positive number or 'auto'")
    if not 0 < args.cpu_budget <= 1 or (args.wall_rate is not None and args.wall_rate <= 0):
        raise UsageError("--cpu-budget must be in (0, 1], --wall-rate positive")
    points: list[ProfilePoint] = []
    for tp, share in keys:
        async with contextlib.AsyncExitStack() as stack:
            estimate: float | None = None
            if args.speedup == "auto" and isinstance(source, EmulatorProcesses):
                target, cal = await stack.enter_async_context(
                    calibrated(
                        source, workload, tp, share, settings, args.cpu_budget, args.wall_rate
                    )
                )
                estimate = cal.capacity
                engine_cpu = "?" if cal.engine_cpu_s is None else f"{cal.engine_cpu_s * 1e3:.2g}"
                console.print(
                    f"{workload.model} tp={tp} share={share:g}: speedup "
                    f"{cal.speedup:g}; probe {cal.estimate:.4g} calls/s (model time) with the "
                    f"engine busy {cal.util:.0%}: capacity ~{cal.capacity:.4g}; CPU per call: client "
                    f"{cal.client_cpu_s * 1e3:.2g} ms, emulator {engine_cpu} ms"
                )
            else:
                target = await stack.enter_async_context(
                    source.serve(
                        workload.model, tp, share, 1.0 if args.speedup == "auto" else fixed
                    )
                )
            tag = f"{workload.model} tp={tp} share={share:g} ({label}, speedup {target.speedup:g})"
            result: SweepResult = await profiler.sweep(
                target, workload, settings, RichProgress(console, tag), estimate
            )
        client_bound = [r.nominal_rate for r in result.points if r.client_bound]
        if client_bound:
            console.print(
                f"[yellow]{tag}: this client could not send {min(client_bound):.3g} "
                "calls/s (it is short of CPU): saturation may read low"
            )
        lagging = [
            r.clock_lag for r in result.points if r.clock_lag is not None and r.clock_lag > 0.05
        ]
        if lagging:
            console.print(
                f"[yellow]{tag}: the emulator's clock lagged up to "
                f"{max(lagging):.0%}: figures are pessimistic; lower --cpu-budget or "
                "--speedup"
            )
        mine, dropped = trusted_points(
            result.points, workload.traced_hit_rate, args.hit_rate_tolerance
        )
        for u in dropped:
            log.warning(
                "%s: point at %.3g calls/s not trusted: %s", tag, u.point.offered_rate, u.reason
            )
            console.print(
                f"[yellow]{tag}: point at {u.point.offered_rate:.3g} calls/s not stored: {u.reason}"
            )
        if mine:
            profiles.save_points(args.store, mine)
        elif dropped:
            console.print(f"[red]{tag}: no point trusted, nothing stored for this key")
        points.extend(mine)
        untrusted.extend(dropped)
    return points


def run(args: argparse.Namespace) -> int:
    console = Console(width=None if Console().is_terminal else 120)
    untrusted: list[Untrusted] = []
    if not 0 <= args.hit_rate_tolerance:
        raise UsageError("--hit-rate-tolerance must not be negative")
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
            profiles.save_points(args.store, points)
            title = f"profile of {args.model} (imported from {args.from_json})"
        else:
            existing_store(args.store)  # replaying reads it; an import may start one
            try:
                workload = replay.load_workload(args.store, args.model)
            except ReplayError as exc:
                raise UsageError(str(exc)) from exc
            except duckdb.Error as exc:
                raise UsageError(f"cannot read the store at {args.store}: {exc}") from exc
            console.print(
                f"{len(workload.calls)} calls of {args.model} in "
                f"{len(workload.groups)} requests to replay"
                + (
                    f" ({workload.skipped} failed or without body skipped)"
                    if workload.skipped
                    else ""
                )
            )
            if workload.traced_hit_rate is not None:
                console.print(f"traced prefix-hit rate {workload.traced_hit_rate:.0%}")
            settings = QUICK if args.quick else SweepSettings()
            points = asyncio.run(_measure(args, workload, console, settings, untrusted))
            engine = "emulated" if args.url is None else "measured"
            title = f"profile of {args.model} ({engine}, model time)"
    except ProfileRunError as exc:
        print(f"scepsy profile: {exc}", file=sys.stderr)
        return 1
    console.print(points_table(points, title))
    for line in saturation_lines(points):
        console.print(line)
    if args.export is not None:
        args.export.write_bytes(export_document(points, untrusted))
    return 0
