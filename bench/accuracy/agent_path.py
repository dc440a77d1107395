"""Benchmark: an agent workflow's capacity and mean latency through the product path, against
emulated engines (every figure here is *emulated*).

``python -m bench.accuracy.agent_path --out DIR [--quick]`` runs, on one machine:

1. a fixed allocation of emulated engines (``scepsy-engine``: the agent's planner on one whole
   A6000, its fan-out worker on another) behind a proxy recording into a fresh store;
2. the trace: ``examples.load --workflow agent`` at a light load, long enough that the
   profiler replays its calls without running out of them;
3. the product path, no hand tuning: ``scepsy stats --json`` on the store, ``scepsy profile``
   of each model from that trace (its default sweep; ``--quick`` in a quick run; fresh
   emulators the profiler starts itself, same keys), and the ALP's ``predict`` on the pipeline the statistics give and the profile book
   the store holds (what the daemon reads): the capacity ``T_w`` and the mean latency at
   fractions of it;
4. the truth: the same workflow driven at those fractions (mean latency of the requests after
   a warm-up, from the store's request spans), and the rate where it stops keeping up,
   bracketed from the predicted ``T_w`` and bisected (:mod:`bench.accuracy.agent_figures`);
5. the report: capacity error (predicted vs the emulated knee; target within 10%) and mean
   latency error per load (target within 15% up to 80%), with the per-stage figures (calls per
   request, call latency per model, tool time) measured beside what the ALP used, so a miss
   can be traced to its term. Writes ``DIR/agent_path.json`` and prints it.

Time: the bench's engines run ``speedup`` model seconds per wall second and the agent's tool
time is scaled to match (``--tool-s`` = model tool seconds / speedup), so the whole workflow
runs ``speedup`` x faster than real time; every rate and time reported is in model time. The
store records wall time, which the product reads as real time (a real engine's speedup is 1):
of the statistics, only the tool time is a duration the ALP takes as it is (``n``, ``p``
and the overlap couplings are ratios), so it is multiplied by the speedup, and the traced
arrival rate divided by it. That is a change of unit, not a tuning.

Invariants: every process started here (engines, proxy, load drivers, profiler) is stopped
before it returns, on errors and interrupts too; every figure is labelled emulated; the
profiler and the statistics are the product's commands, run as a user runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.accuracy.agent_figures import (
    LABEL,
    Bracket,
    RunJudgement,
    Span,
    curve_doc,
    expected_calls,
    judge,
    knee_doc,
    mean_latency,
    next_rate,
    num,
    pipeline_from_stats,
    prediction_doc,
    relative_error,
    summary,
)
from bench.speed.emulator_lag import (
    REPO,
    EmulatedStack,
    EngineProcess,
    lags,
    reexec_single_threaded,
    scrape_all,
    single_threaded_env,
)
from examples.agent_loop import AgentConfig
from optimizer.model.alp import ModelAlloc, Pipeline, predict
from optimizer.model.curves import ProfileBook
from optimizer.stats.figures import Window
from optimizer.stats.reader import summarise_store
from optimizer.store import profiles
from shared.store import StoreReader

WORKFLOW = "agent"
GPU = "a6000"
AGENT = AgentConfig()
MODELS = (AGENT.planner, AGENT.worker)
ALLOCATION = {m: ModelAlloc(replicas=1, tp=1, share=1.0) for m in MODELS}
# The proxy writes a segment at least this often (shared.settings.StoreSettings' default):
# a run's records are all readable this long after its last call ended.
STORE_FLUSH_S = 5.0
MS = 1e6  # microseconds per second


@dataclass(frozen=True)
class Plan:
    """One run's sizes; times are model seconds, rates requests per model second."""

    # 4 model s per wall s: the emulators kept their clock (lag < 0.1%) at 4.4 req/s
    # (~140 calls per wall second through one proxy) on this 2-core machine, shared.
    speedup: float = 4.0
    trace_rate: float = 1.0  # light: about a fifth of what one A6000 planner sustains
    trace_s: float = 300.0  # ~1,050 planner and ~1,150 worker calls
    loads: tuple[float, ...] = (0.2, 0.5, 0.8)
    latency_s: float = 180.0  # of arrivals per latency run
    latency_warm: float = 0.25  # of those, before the mean is taken
    knee_s: float = 240.0  # of arrivals per knee probe
    knee_step: float = 1.1
    knee_precision: float = 0.05
    knee_probes: int = 4
    profile_quick: bool = False  # scepsy profile --quick
    profile_timeout_s: float = 420.0  # wall, per model


# ~15 minutes: the profiles take ~7 of them (the planner's default sweep ~4.4 at the speed-up
# its --cpu-budget allows). These sizes ran 863 s (bench/results/agent_path.json); 200-s
# latency runs and 280-s probes had run 939 s.
FULL = Plan()
# the profiles take ~3 of its ~6 minutes; two knee probes bracket the knee only when the
# prediction is within one step of it
QUICK = Plan(
    trace_s=120.0,
    latency_s=80.0,
    knee_s=140.0,
    knee_step=1.15,
    knee_precision=0.15,
    knee_probes=2,
    profile_quick=True,
    profile_timeout_s=300.0,
)
# scepsy profile --cpu-budget: the share of a core its emulator may spend at saturation. At
# the default 0.3 its --speedup auto chose 25-26 on this shared 2-core machine and the
# emulator's clock lagged 14-40% at the overloaded points, so T_m read low (14.1 calls/s for
# the planner, against 15.7-16.7 in runs that did not lag); the profiler's own warning says
# to lower it.
PROFILE_CPU_BUDGET = 0.15


def profile_argv(plan: Plan, store: Path, model: str, export: Path) -> list[str]:
    """``scepsy profile`` of ``model`` at the allocation's key, from the store's trace."""
    key = ALLOCATION[model]
    flags = {
        "--store": store,
        "--model": model,
        "--gpu": GPU,
        "--tp": key.tp,
        "--shares": key.share,
        "--cpu-budget": PROFILE_CPU_BUDGET,
        "--export": export,
    }
    return ["profile", *_argv(flags), *(["--quick"] if plan.profile_quick else [])]


def _argv(flags: dict[str, object]) -> list[str]:
    return [word for flag, value in flags.items() for word in (flag, str(value))]


def notable(log: str) -> list[str]:
    """The lines of a ``scepsy profile`` run that say how far to trust it."""
    words = ("speedup", "lagged", "saturation", "not stored", "could not send", "prefix-hit")
    return [" ".join(ln.split()) for ln in log.splitlines() if any(w in ln for w in words)]


# ---- effects -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One load driver run: its nominal rate and span (model time), its wall bounds (µs)."""

    rate: float
    duration: float
    t_from_us: int
    t_to_us: int
    client: dict[str, Any]  # examples.load's report, latencies in model seconds
    max_lag: float  # the emulators' worst clock lag over the run
    load_average: float  # 1-minute, at its end


async def _subprocess(argv: list[str], timeout_s: float, log: Path) -> tuple[int, bytes]:
    """Run ``python -m ...`` to completion (killed past ``timeout_s`` or if cancelled)."""
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *argv,
            cwd=REPO,
            env=single_threaded_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out


async def drive(
    stack: EmulatedStack, plan: Plan, rate: float, duration: float, seed: int, logs: Path
) -> Run:
    """``examples.load --workflow agent`` at ``rate`` for ``duration`` (model time)."""
    s = plan.speedup
    before = await scrape_all(stack)
    t_from = int(time.time() * MS)
    flags = {
        "--workflow": WORKFLOW,
        "--rate": rate * s,
        "--duration": duration / s,
        "--seed": seed,
        "--tool-s": AGENT.tool_s / s,
        "--base-url": stack.base_url,
    }
    code, out = await _subprocess(
        ["-m", "examples.load", *_argv(flags)],
        timeout_s=duration / s * 4 + 120,
        log=logs / f"load-{seed}.log",
    )
    t_to = int(time.time() * MS)
    if code != 0:
        raise RuntimeError(f"examples.load exited with {code}: see {logs / f'load-{seed}.log'}")
    after = await scrape_all(stack)
    report = json.loads(out)["workflows"][WORKFLOW]
    report["latency_model_s"] = {k: v * s for k, v in report.pop("latency_s").items()}
    report["throughput_rps"] *= 1 / s
    report["offered_rate_rps"] *= 1 / s
    lag = max(e["lag_ratio"] for e in lags(stack, before, after).values())
    return Run(rate, duration, t_from, t_to, report, lag, os.getloadavg()[0])


async def settled(run: Run) -> None:
    """Wait until the proxy has written every record of ``run``."""
    left = STORE_FLUSH_S + 1.0 - (time.time() - run.t_to_us / MS)
    if left > 0:
        await asyncio.sleep(left)


def spans(store: Path, run: Run, speedup: float) -> list[Span]:
    """Each request of ``run``: first call start, last call end, model s from its start."""
    reader = StoreReader(store)
    try:
        rows = reader.read(
            lambda calls: (
                calls.filter(f"workflow = '{WORKFLOW}' AND request_id IS NOT NULL")
                .aggregate("request_id, min(t_start), max(t_end)", "request_id")
                .fetchall()
            ),
            run.t_from_us,
            run.t_to_us,
        )
    finally:
        reader.close()
    k = speedup / MS
    return [Span((a - run.t_from_us) * k, (e - run.t_from_us) * k) for _, a, e in rows if e]


def measured_stages(store: Path, run: Run, plan: Plan) -> dict[str, Any]:
    """What the product's statistics read from a truth run's requests after its warm-up
    (model time): calls per request, mean call latency per model, tool time, latency."""
    warm_us = int(plan.latency_warm * run.duration / plan.speedup * MS)
    stats = summarise_store(store, Window(run.t_from_us + warm_us, run.t_to_us))
    wf = stats.get(WORKFLOW)
    if wf is None:
        return {}
    s = plan.speedup
    return {
        "requests": wf.requests,
        "latency_mean_s": wf.latency_mean * s,
        "tool_time_mean_s": wf.tool_time_mean * s,
        "models": {
            m: {"n": ms.n, "p_agg": ms.p_agg, "call_latency_s": ms.latency_mean * s}
            for m, ms in wf.models.items()
        },
    }


async def scepsy(args: list[str], timeout_s: float, log: Path) -> bytes:
    code, out = await _subprocess(["-m", "optimizer.cli", *args], timeout_s, log)
    log.with_suffix(".out").write_bytes(out)
    if code != 0:
        raise RuntimeError(f"scepsy {args[0]} exited with {code}: see {log}")
    return out


def _run_doc(run: Run) -> dict[str, Any]:
    return {
        "rate": run.rate,
        "duration_s": run.duration,
        "client": run.client,
        "emulator_max_lag": run.max_lag,
        "load_average_1m": run.load_average,
    }


async def product_path(
    stack: EmulatedStack, plan: Plan, work: Path, doc: dict[str, Any]
) -> tuple[Pipeline, ProfileBook]:
    """``scepsy stats`` and ``scepsy profile`` on the trace, as a user runs them; the
    pipeline and profile book the ALP predicts from (what the daemon would read)."""
    store = stack.store
    raw = await scepsy(["stats", "--store", str(store), "--json"], 120, work / "stats.log")
    doc["stats"] = wf = json.loads(raw)["workflows"][WORKFLOW]
    doc["profile_logs"] = {}
    for m in MODELS:
        log = work / f"profile-{m}.log"
        argv = profile_argv(plan, store, m, work / f"profile-{m}.json")
        await scepsy(argv, plan.profile_timeout_s, log)
        notes = notable(log.with_suffix(".out").read_text())
        doc["profile_logs"][m] = {"command": " ".join(["scepsy", *argv]), "notes": notes}
    return pipeline_from_stats(WORKFLOW, wf, plan.speedup), ProfileBook(profiles.load_points(store))


def predicted_doc(
    pipeline: Pipeline, book: ProfileBook, wf: dict[str, Any], plan: Plan
) -> dict[str, Any]:
    """The ALP's capacity, and its predictions at the traced rate and at the loads."""
    capacity = predict(pipeline, book, ALLOCATION, 1e-9).throughput
    traced = predict(pipeline, book, ALLOCATION, float(wf["arrival_rate"]) / plan.speedup)
    return {
        "pipeline": {
            "stages": [asdict(s) for s in pipeline.stages],
            "overlap": pipeline.overlap,
            "tool_time_s": pipeline.tool_time,
            "overlaps": [asdict(o) for o in pipeline.overlaps],
        },
        "profiles": {m: curve_doc(book, m, ALLOCATION[m]) for m in MODELS},
        "capacity": capacity,
        "at_traced_rate": prediction_doc(traced)
        | {"traced_latency_mean_s": float(wf["latency_mean"]) * plan.speedup},
        "at_loads": {
            str(f): prediction_doc(predict(pipeline, book, ALLOCATION, f * capacity))
            for f in plan.loads
        },
    }


async def knee_search(
    stack: EmulatedStack, plan: Plan, capacity: float, work: Path
) -> tuple[Bracket, list[tuple[Run, RunJudgement]]]:
    """Runs from the predicted capacity until the knee is bracketed (bench.accuracy.agent_figures)."""
    bracket, probes = Bracket(), list[tuple[Run, RunJudgement]]()
    while len(probes) < plan.knee_probes:
        rate = next_rate(bracket, capacity, plan.knee_step, plan.knee_precision)
        if rate is None:
            break
        run = await drive(stack, plan, rate, plan.knee_s, 20 + len(probes), work)
        await settled(run)
        probes.append((run, judge(spans(stack.store, run, plan.speedup), rate, plan.knee_s)))
        bracket = bracket.add(probes[-1][1])
    return bracket, probes


def latency_doc(store: Path, run: Run, predicted: float | None, plan: Plan) -> dict[str, Any]:
    """A latency run's mean after its warm-up against the prediction, and its stages."""
    mean, se, n = mean_latency(spans(store, run, plan.speedup), run.duration, plan.latency_warm)
    return _run_doc(run) | {
        "measured_mean_s": mean,
        "measured_se_s": se,
        "requests": n,
        "predicted_mean_s": predicted,
        "error": num(relative_error(math.inf if predicted is None else predicted, mean)),
        "measured_stages": measured_stages(store, run, plan),
    }


async def measure(plan: Plan, out: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    doc: dict[str, Any] = {
        "label": LABEL,
        "units": "model seconds (wall x speedup); rates per model second",
        "plan": asdict(plan),
        "allocation": {m: asdict(a) | {"gpu": GPU} for m, a in ALLOCATION.items()},
        "agent": asdict(AGENT),
        "expected_calls_per_request": expected_calls(AGENT),
    }
    async with EmulatedStack([EngineProcess(m, GPU) for m in MODELS], plan.speedup, work) as st:
        trace = await drive(st, plan, plan.trace_rate, plan.trace_s, 1, work)
        doc["trace"] = _run_doc(trace)
        await settled(trace)
        pipeline, book = await product_path(st, plan, work, doc)
        doc["predicted"] = pred = predicted_doc(pipeline, book, doc["stats"], plan)
        doc["timeline_s"] = {"product_path_done": time.monotonic() - t0}
        capacity = pred["capacity"]
        runs = [
            await drive(st, plan, f * capacity, plan.latency_s, 10 + i, work)
            for i, f in enumerate(plan.loads)
        ]
        doc["timeline_s"]["latency_runs_done"] = time.monotonic() - t0
        bracket, probes = await knee_search(st, plan, capacity, work)
        doc["timeline_s"]["knee_done"] = time.monotonic() - t0
        await settled(runs[-1])
        doc["latency"] = {
            str(f): latency_doc(st.store, run, pred["at_loads"][str(f)]["latency_s"], plan)
            for f, run in zip(plan.loads, runs, strict=True)
        }
    probe_docs = [(_run_doc(r), j) for r, j in probes]
    doc["knee"] = knee_doc(bracket, probe_docs, capacity, plan.knee_precision)
    doc["summary"] = summary(doc, plan.speedup)
    doc["timeline_s"]["total"] = time.monotonic() - t0
    return doc


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--quick", action="store_true", help="shorter runs, coarser knee (~6 min)")
    args = p.parse_args(argv)
    reexec_single_threaded("bench.accuracy.agent_path", sys.argv[1:] if argv is None else argv)
    plan = QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    doc = asyncio.run(measure(plan, args.out))
    (args.out / "agent_path.json").write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc["summary"], indent=2))


if __name__ == "__main__":
    main()
