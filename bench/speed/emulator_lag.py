"""Emulated engines and the proxy as real processes, and how far the emulators lag their clock.

Role: ``EmulatedStack`` starts one ``scepsy-engine`` process per replica (``python -m sim.cli``,
each its own process so it gets its own CPU time slice) and one proxy process
(``python -m proxy.cli``) in front of them, waits until every one answers ``/health``, and stops
them all on exit (SIGTERM, then SIGKILL past a grace). ``scrape`` reads an emulator's
``/metrics``; ``lag_over`` turns two scrapes into the lag over the window between them;
``recorded_calls`` summarises what the proxy's store holds for a time window.

As a benchmark (``python -m bench.speed.emulator_lag --out DIR [--quick]``): the demo-sized stack (the
five models of both example workflows) at a speed-up, with ``examples.load`` driving both
workflows through the proxy; writes DIR/emulator_lag.json with each emulator's lag.

Invariants: every figure from these engines is labelled "emulated"; the lag over a window is
the emulator's lost wall seconds (steps that ran longer than the model asked, net of catch-up)
over the window's wall seconds, so 0.05 means its model clock fell 5% behind wall x speed-up;
no process outlives the stack (``stop`` runs in a ``finally``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from shared.ports import free_port
from shared.store import StoreReader

REPO = Path(__file__).resolve().parents[2]
LABEL = "emulated"
# Model seconds per wall second that keep the demo stack's lag small on a loaded 2-core box.
DEMO_SPEEDUP = 4.0
# One BLAS thread per process: OpenBLAS's spinning worker threads otherwise take a loaded
# 2-core machine's CPU from the event loops whose timing is being measured.
SINGLE_THREADED = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def single_threaded_env() -> dict[str, str]:
    return os.environ | SINGLE_THREADED


def reexec_single_threaded(module: str, argv: Sequence[str]) -> None:
    """Restart this benchmark with one BLAS thread unless it already has it (the variable is
    read when numpy loads, so it must be set before this process imported it)."""
    if os.environ.get("OPENBLAS_NUM_THREADS") != "1":
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], single_threaded_env())


@dataclass(frozen=True)
class EngineProcess:
    """One emulated replica: ``scepsy-engine`` flags beyond model, GPU, TP and share."""

    model: str
    gpu: str = "a6000"
    tp: int = 1
    share: float = 1.0
    extra: tuple[str, ...] = ()  # e.g. the step-length model


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path


@dataclass
class EmulatedStack:
    """Emulator processes behind one proxy process (``async with`` starts and stops them)."""

    engines: Sequence[EngineProcess]
    speedup: float
    workdir: Path
    seed: int = 0
    emulators: list[_Child] = field(default_factory=list)
    proxy: _Child | None = None

    @property
    def store(self) -> Path:
        return self.workdir / "store"

    @property
    def base_url(self) -> str:
        assert self.proxy is not None
        return f"{self.proxy.url}/v1"

    def _spawn(self, name: str, args: list[str], url: str) -> _Child:
        log = self.workdir / f"{name}.log"
        with log.open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, *args],
                cwd=REPO,
                env=single_threaded_env(),
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        return _Child(name, proc, url, log)

    async def __aenter__(self) -> EmulatedStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for i, e in enumerate(self.engines):
                port = free_port()
                self.emulators.append(
                    self._spawn(
                        f"engine-{i}-{e.model}",
                        [
                            "-m",
                            "sim.cli",
                            "--model",
                            e.model,
                            "--gpu",
                            e.gpu,
                            "--tp",
                            str(e.tp),
                            "--share",
                            str(e.share),
                            "--port",
                            str(port),
                            "--speedup",
                            str(self.speedup),
                            "--seed",
                            str(self.seed),
                            *e.extra,
                        ],
                        f"http://127.0.0.1:{port}",
                    )
                )
            await asyncio.gather(*(_ready(c) for c in self.emulators))
            port = free_port()
            ups = [
                a
                for e, c in zip(self.engines, self.emulators, strict=True)
                for a in ("--upstream", f"{e.model}={c.url}")
            ]
            self.proxy = self._spawn(
                "proxy",
                [
                    "-m",
                    "proxy.cli",
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--store",
                    str(self.store),
                    "--log-level",
                    "WARNING",
                    *ups,
                ],
                f"http://127.0.0.1:{port}",
            )
            await _ready(self.proxy)
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by each child (proxy and emulators)."""
        children = ([self.proxy] if self.proxy else []) + self.emulators
        return {c.name: cpu_seconds(c.proc.pid) for c in children if c.proc.poll() is None}

    def stop(self) -> None:
        """SIGTERM everything (the proxy first, so it flushes its store), SIGKILL past 20 s."""
        children = ([self.proxy] if self.proxy else []) + self.emulators
        for child in children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.proc.wait(20.0)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()


async def _ready(child: _Child, timeout_s: float = 60.0) -> None:
    """Poll ``/health`` until it answers 200; fail with the child's log if it exits."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                break
            try:
                async with session.get(f"{child.url}/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(
        f"{child.name} did not become healthy: {child.log.read_text(errors='replace')[-2000:]}"
    )


async def scrape(url: str) -> dict[str, float]:
    """An emulator's metrics as ``{name: value}`` (one model per emulator; buckets dropped)."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "_bucket{" in line:
            continue
        name, _, value = line.rpartition(" ")
        out[name.split("{", 1)[0]] = float(value)
    return {"t_wall": time.monotonic()} | out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lag_over(before: dict[str, float], after: dict[str, float], speedup: float) -> dict[str, float]:
    """One emulator's lag and work over the window between two scrapes."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    wall = max(delta("t_wall"), 1e-9)
    busy = delta("scepsy_emulator_model_busy_seconds_total")
    queries = delta("vllm:prefix_cache_queries_total")
    return {
        "lag_ratio": delta("scepsy_emulator_lost_wall_seconds_total") / wall,
        "lost_wall_s": delta("scepsy_emulator_lost_wall_seconds_total"),
        "clock_lag_gauge_at_end": after.get("scepsy_emulator_clock_lag_ratio", 0.0),
        "step_stretch_at_end": after.get("scepsy_emulator_step_stretch_ratio", 0.0),
        "steps": delta("scepsy_emulator_steps_total"),
        "utilisation": busy / (wall * speedup),
        "prefix_hit_rate": delta("vllm:prefix_cache_hits_total") / queries if queries else 0.0,
        "preemptions": delta("vllm:num_preemptions_total"),
    }


async def scrape_all(stack: EmulatedStack) -> list[dict[str, float]]:
    return list(await asyncio.gather(*(scrape(c.url) for c in stack.emulators)))


def lags(
    stack: EmulatedStack, before: list[dict[str, float]], after: list[dict[str, float]]
) -> dict[str, dict[str, float]]:
    return {
        f"{e.model}/{i}": lag_over(b, a, stack.speedup)
        for i, (e, b, a) in enumerate(zip(stack.engines, before, after, strict=True))
    }


def recorded_calls(
    store: Path, t_from_us: int | None = None, t_to_us: int | None = None
) -> dict[str, Any]:
    """Per model: calls the proxy recorded (ok / not ok) and their mean token counts."""
    reader = StoreReader(store)
    try:
        rows = (
            reader.calls(t_from_us, t_to_us)
            .aggregate(
                "model, count(*) FILTER (WHERE status = 200) AS ok, "
                "count(*) FILTER (WHERE status IS NULL OR status <> 200) AS not_ok, "
                "avg(prompt_tokens) AS prompt_tokens, avg(completion_tokens) AS completion_tokens, "
                "avg(cached_tokens) AS cached_tokens, "
                "avg(t_end - t_start) FILTER (WHERE status = 200) AS mean_call_us",
                "model",
            )
            .fetchall()
        )
    finally:
        reader.close()
    return {
        str(m): {
            "ok": int(ok),
            "not_ok": int(bad),
            "mean_prompt_tokens": pt,
            "mean_completion_tokens": ct,
            "mean_cached_tokens": cached,
            "mean_call_wall_ms": us / 1000 if us is not None else None,
        }
        for m, ok, bad, pt, ct, cached, us in sorted(rows, key=lambda r: str(r[0]))
    }


# --- the benchmark: lag at the demo's load ---------------------------------------------------

DEMO_ENGINES = (
    EngineProcess("llama-3.2-1b", "a100"),
    EngineProcess("llama-3.1-8b-prm", "a100"),
    EngineProcess("e5-base-v2", "a100", share=0.5),
    EngineProcess("bge-reranker-base", "a100", share=0.5),
    EngineProcess("llama-3-8b", "a100"),
)


@dataclass(frozen=True)
class LagPlan:
    speedup: float
    rates: tuple[float, float]  # beam, rag: workflow requests per model second
    duration_s: float  # model seconds of arrivals


async def measure(plan: LagPlan, workdir: Path) -> dict[str, Any]:
    async with EmulatedStack(DEMO_ENGINES, plan.speedup, workdir) as stack:
        before = await scrape_all(stack)
        load0 = os.getloadavg()
        wall_rates = ",".join(str(r * plan.speedup) for r in plan.rates)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "examples.load",
            "--workflow",
            "beam,rag",
            "--rate",
            wall_rates,
            "--duration",
            str(plan.duration_s / plan.speedup),
            "--base-url",
            stack.base_url,
            "--passages",
            "500",
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            env=single_threaded_env(),
        )
        out, _ = await proc.communicate()
        after = await scrape_all(stack)
        report = json.loads(out)
    for wf in report["workflows"].values():  # wall seconds -> model seconds
        wf["latency_model_s"] = {k: v * plan.speedup for k, v in wf.pop("latency_s").items()}
    engines = lags(stack, before, after)
    return {
        "label": LABEL,
        "plan": asdict(plan),
        "load_average": [load0, os.getloadavg()],
        "engines": engines,
        "load": report,
        "calls": recorded_calls(stack.store),
        "summary": {
            "max_lag_ratio": max(e["lag_ratio"] for e in engines.values()),
            "speedup": plan.speedup,
        },
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Emulator clock lag at the demo's load (emulated).")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--speedup", type=float, default=DEMO_SPEEDUP)
    args = p.parse_args(argv)
    reexec_single_threaded("bench.speed.emulator_lag", sys.argv[1:] if argv is None else argv)
    plan = LagPlan(args.speedup, (0.2, 2.0), 60.0 if args.quick else 240.0)
    args.out.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(measure(plan, args.out / "work"))
    (args.out / "emulator_lag.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
