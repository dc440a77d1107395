"""The proxy overhead benchmark's report: its summary figures, its targets and whether they
were met, the notes on contention, and the console table of the HTTP phases.

Works on the measured report only (the dicts ``bench.proxy.overhead`` builds); it measures and
starts nothing.

Invariants: every figure in ``summary`` is computed from the measurements passed in (a figure
whose measurement is missing is None, never estimated); ``targets`` states each target of issues
2 and 26 and whether this run met it (``met`` is null where a figure it needs was not measured,
e.g. a peer not installed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from bench.proxy.peers import PEERS, SCEPSY
from bench.proxy.servers import Placement


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


def _run(runs: list[dict[str, Any]], target: str, c: int) -> dict[str, Any] | None:
    return next((r for r in runs if r["target"] == target and r["concurrency"] == c), None)


def _cpu_ms(run: dict[str, Any] | None, unit: str) -> float | None:
    cpu = None if run is None else run.get("server_cpu_s")
    return None if run is None or cpu is None or not run[unit] else round(cpu * 1e3 / run[unit], 4)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def server_figures(name: str, phase: dict[str, Any]) -> dict[str, Any]:
    """One server's summary figures (see ``bench.proxy.overhead``)."""
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
