"""Golden figures: the simulator's results for a few small seeded scenarios never change.

Role: a guard for speed work on ``sim.des`` / ``sim.engine`` / ``sim.cluster`` / ``sim.perf`` /
``sim.dynamic`` / ``sim.hpa`` / ``sim.multiplex``: each scenario's full figures (every
``SimResult`` field except wall time, every request's span, the call trace where recorded, the
autoscaler's log and changes) are compared with ``des_golden.json``, captured from the simulator
before its event loop and engine were optimised. Floats compare exactly (JSON round-trips them):
the optimisations keep every arithmetic operation in its original order.

Regenerate (only for an intended change of the model): ``python -m tests.sim.test_des_golden``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sim.cluster import Allocation
from sim.des import RequestSpan, SimResult, WorkloadSpec, simulate, simulate_requests
from sim.dynamic import DynamicSimulation, run_dynamic
from sim.hpa import Hpa, HpaSettings
from sim.multiplex import simulate_pooled
from sim.workflows import BeamParams, RagParams

GOLDEN = Path(__file__).with_name("des_golden.json")
BEAM_MODELS = ("llama-3.2-1b", "llama-3.1-8b-prm")


def _plain(x: Any) -> Any:
    """JSON-ready, with non-finite floats as strings (JSON has none) and tuples as lists."""
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def _figures(res: SimResult) -> dict[str, Any]:
    out = res.summary()
    out.pop("wall_s")
    # the call trace as a digest of its rows (the fixture stays small; any change shows)
    rows = [
        [c.call_id, c.request_id, c.replica, c.t_start, c.t_first, c.t_end, c.cached_tokens]
        for c in res.calls
    ]
    out["calls"] = [len(rows), hashlib.sha256(json.dumps(rows).encode()).hexdigest()]
    return out


def _static(
    alloc: Allocation, spec: WorkloadSpec, seconds: float, warmup_s: float, seed: int
) -> tuple[SimResult, tuple[RequestSpan, ...]]:
    """A recorded static run of ``seconds`` of arrivals, drained as long."""
    return simulate_requests(
        alloc,
        [spec],
        duration_s=seconds,
        warmup_s=warmup_s,
        drain_s=seconds,
        seed=seed,
        record_calls=True,
    )


def static_beam() -> dict[str, Any]:
    """Beam search on co-located half-GPU generators (contention) and whole-GPU verifiers."""
    alloc = Allocation.of(
        ("llama-3.2-1b", "a6000", 1, 0.5, 2), ("llama-3.1-8b-prm", "a6000", 1, 1.0, 2)
    )
    res, spans = _static(alloc, WorkloadSpec("beam", 1.5, BeamParams()), 40.0, 8.0, 3)
    return {"result": _figures(res), "spans": [list(vars(s).values()) for s in spans]}


def static_rag() -> dict[str, Any]:
    """RAG with encoders sharing a GPU (fractional) and a tensor-parallel generator pair."""
    alloc = Allocation.of(
        ("e5-base-v2", "a6000", 1, 0.2, 1),
        ("bge-reranker-base", "a6000", 1, 0.3, 1),
        ("llama-3-8b", "a6000", 2, 1.0, 1),
        ("llama-3-8b", "a6000", 1, 0.5, 2),
    )
    res, _ = _static(alloc, WorkloadSpec("rag", 12.0, RagParams()), 20.0, 2.0, 5)
    return {"result": _figures(res)}


def colocated_combined() -> dict[str, Any]:
    """Beam and RAG together on fractional shares of the same GPUs, also step by step and
    Ayo-style (no prefix cache, priority scheduling), under each routing policy."""
    alloc = Allocation.of(
        ("llama-3.2-1b", "a6000", 1, 0.4, 2),
        ("llama-3.1-8b-prm", "a6000", 1, 0.6, 2),
        ("e5-base-v2", "a6000", 1, 0.1, 1),
        ("bge-reranker-base", "a6000", 1, 0.3, 1),
        ("llama-3-8b", "a6000", 1, 0.6, 2),
    )
    specs = [WorkloadSpec("beam", 0.8), WorkloadSpec("rag", 6.0)]
    run = {"duration_s": 25.0, "warmup_s": 5.0, "drain_s": 30.0, "seed": 11}
    out = {
        "ff": _figures(simulate(alloc, specs, **run)),  # type: ignore[arg-type]
        "steps": _figures(simulate(alloc, specs, fast_forward=False, **run)),  # type: ignore[arg-type]
        "ayo": _figures(
            simulate(alloc, specs, enable_prefix_caching=False, scheduling="priority", **run)  # type: ignore[arg-type]
        ),
    }
    for routing in ("p2c", "least", "affinity"):
        out[routing] = _figures(simulate(alloc, specs, routing=routing, **run))  # type: ignore[arg-type]
    return out


def dynamic_hpa() -> dict[str, Any]:
    """The autoscaler from one pod per model on 6 GPUs, the load dropping mid-run: starts,
    pending pods, scale-down (a short stabilisation window) and drains."""
    hpa = Hpa(BEAM_MODELS, 6, settings=HpaSettings(scale_down_window_s=30.0))
    sim = DynamicSimulation(hpa.initial(None), [WorkloadSpec("beam", 2.0)], 7, hpa, 20.0)
    sim.at(90.0, lambda: sim.set_rate(0, 0.3))
    res = run_dynamic(sim, 150.0, 30.0, 40.0)
    return {
        "result": _figures(res),
        "log": hpa.log,
        "changes": [list(vars(c).values()) for c in sim.changes],
    }


def pooled() -> dict[str, Any]:
    """Aegaeon-style pooled instances (model switches, prefill/decode hand-over)."""
    res, switches = simulate_pooled(
        [WorkloadSpec("beam", 0.4), WorkloadSpec("rag", 3.0)],
        4,
        2,
        duration_s=20.0,
        warmup_s=4.0,
        drain_s=30.0,
        seed=2,
    )
    return {"result": _figures(res), "switches": switches}


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    f.__name__: f for f in (static_beam, static_rag, colocated_combined, dynamic_hpa, pooled)
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_matches_its_golden_figures(name: str) -> None:
    golden = json.loads(GOLDEN.read_text())[name]
    got = json.loads(json.dumps(_plain(SCENARIOS[name]())))
    assert got == golden


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({k: _plain(f()) for k, f in SCENARIOS.items()}) + "\n")
