"""The discrete-event simulator: engine replicas, a router and workflow traffic on a virtual clock.

Role: evaluate an allocation in seconds instead of GPU-hours. Workflow requests arrive as
independent Poisson processes (one per ``WorkloadSpec``), run their stochastic control flow
(``sim.workflows``), and send calls through the router to engine replicas (``sim.cluster``);
each replica's ``EngineCore`` advances one step per event, the step lasting what the
performance model says. Results are per-workflow throughput and latency, labelled "simulated".

Invariants:
- one heap event per engine step, per arrival and per non-LLM delay; never one per token;
- a call submitted while its replica is mid-step joins the next step (continuous batching);
- the same (allocation, workloads, seed, settings) gives the same result;
- requests arriving in ``[warmup_s, horizon)`` are measured; the run drains started requests
  for at most ``drain_s`` past the last arrival, and counts the unfinished as failed;
- a call the engine refuses (too long for the model or the KV cache) fails its request.

Engine options (``engine_kw``, ``simulate``'s keywords): ``enable_prefix_caching=False``
models engines without automatic prefix caching (vLLM v0.2); ``scheduling="priority"`` serves
the waiting calls of the earliest-started workflow request first (every engine request's
priority is its workflow request's arrival; ignored under the default FCFS).

Run-time changes (autoscalers, controllers): build a :class:`Simulation`, schedule callables
with :meth:`Simulation.at`; they may add replicas, withdraw them from routing (in-flight calls
finish: a drain) and change a workload's rate while requests are in flight.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from sim.cluster import Allocation, Replica, Router, RoutingPolicy, build_replicas
from sim.engine import EngineRequest, StepOutcome
from sim.results import LatencyStats, ReplicaResult, SimCall, SimResult, WorkflowResult
from sim.workflows import (
    BeamParams,
    Call,
    Delay,
    FanoutParams,
    RagParams,
    WorkflowGen,
    WorkflowParams,
    models_of,
    start_workflow,
)

__all__ = [
    "LatencyStats",
    "ReplicaResult",
    "RequestSpan",
    "SimCall",
    "SimResult",
    "Simulation",
    "WorkflowResult",
    "WorkloadSpec",
    "simulate",
    "simulate_requests",
]

LABEL = "simulated"
_DEFAULTS: dict[str, WorkflowParams] = {
    "beam": BeamParams(),
    "rag": RagParams(),
    "fanout": FanoutParams(),
}


@dataclass(frozen=True)
class WorkloadSpec:
    workflow: Literal["beam", "rag", "fanout"]
    rate: float  # workflow requests per second (Poisson)
    params: WorkflowParams | None = None  # None: the workflow's defaults
    name: str | None = None  # None: the workflow's name

    @property
    def label(self) -> str:
        return self.name or self.workflow

    def resolved(self) -> WorkflowParams:
        params = self.params or _DEFAULTS[self.workflow]
        expected = type(_DEFAULTS[self.workflow])
        if not isinstance(params, expected):
            raise ValueError(f"{self.label}: params must be {expected.__name__}")
        return params


@dataclass
class _Run:
    workflow: int
    rid: str
    key: int
    gen: WorkflowGen
    arrival: float
    pending: int = 0
    failed: bool = False
    end: float = -1.0
    calls: dict[str, int] = field(default_factory=dict)


@dataclass
class _CallState:
    cid: int
    run: _Run
    call: Call
    replica: Replica
    t_start: float
    remaining: int
    t_first: float = -1.0
    cached: int = 0


_ARRIVAL, _STEP_END, _RESUME, _RUN_END, _CONTROL = 0, 1, 2, 3, 4
_MIN_RUN = 2  # decode steps worth fast-forwarding as one event


class Simulation:
    """The event loop (``simulate`` runs one to the end; see the module docstring for changes
    at run time). ``engine_kw``: ``sim.cluster.build_replicas``' engine settings."""

    def __init__(
        self,
        allocation: Allocation,
        workloads: Sequence[WorkloadSpec],
        seed: int = 0,
        routing: RoutingPolicy = "prefix_affinity",
        record_calls: bool = False,
        fast_forward: bool = True,
        engine_kw: dict[str, Any] | None = None,
        replicas: Mapping[str, Sequence[Replica]] | None = None,
    ) -> None:
        """``replicas``: prebuilt replicas by the models they serve, used instead of the
        allocation's (a replica may serve several models: ``sim.multiplex``)."""
        self.fast_forward = fast_forward
        if replicas is None:
            self.replicas = build_replicas(allocation, **(engine_kw or {}))
            served = allocation.models()
        else:
            self.replicas = list(dict.fromkeys(r for pool in replicas.values() for r in pool))
            served = {m for m, pool in replicas.items() if pool}
        self.router = Router(self.replicas, routing, random.Random(seed))
        if replicas is not None:
            self.router.by_model = {m: list(pool) for m, pool in replicas.items()}
        self.workloads = list(workloads)
        self.params = [w.resolved() for w in self.workloads]
        for w, p in zip(self.workloads, self.params, strict=True):
            missing = set(models_of(p)) - served
            if missing:
                raise ValueError(f"{w.label}: no replica serves {', '.join(sorted(missing))}")
        self.seed = seed
        self.record = record_calls
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.runs: list[_Run] = []
        self.inflight: dict[str, _CallState] = {}
        self.rid_counter = itertools.count()
        self.call_counter = itertools.count()
        self.trace: list[SimCall] = []
        self.events = 0

    def push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, payload))

    # --- run-time changes (the public hook) ---------------------------------------------
    def at(self, t: float, fire: Callable[[], None]) -> None:
        """Call ``fire()`` at simulated time ``t`` (it may schedule more with ``at``)."""
        self.push(t, _CONTROL, fire)

    def serving(self, model: str) -> list[Replica]:
        """The replicas new calls of ``model`` are routed to."""
        return list(self.router.by_model.get(model, []))

    def add_replicas(self, replicas: Sequence[Replica]) -> None:
        """Route calls to ``replicas`` too (from ``build_replicas``: co-location contention
        is modelled among replicas built together only)."""
        for r in replicas:
            self.replicas.append(r)
            self.router.by_model.setdefault(r.spec.model, []).append(r)

    def withdraw(self, replica: Replica) -> bool:
        """Route no new calls to ``replica``; it finishes what it holds. A model keeps its
        last serving replica (False: not withdrawn)."""
        pool = self.router.by_model.get(replica.spec.model, [])
        if replica not in pool or len(pool) < 2:
            return False
        pool.remove(replica)
        return True

    def set_rate(self, index: int, rate: float) -> None:
        """Workload ``index``'s rate from its next arrival on (a workload that started at rate
        0 has no next arrival)."""
        w = self.workloads[index]
        self.workloads[index] = WorkloadSpec(w.workflow, rate, w.params, w.name)

    def result(self, warmup_s: float, window_end: float, wall_s: float = 0.0) -> SimResult:
        """The figures of a finished :meth:`run` (``window_end``: what it returned)."""
        return _result(self, warmup_s, window_end, wall_s)

    # --- workflow requests --------------------------------------------------------------
    def start_run(self, w: int, index: int) -> None:
        rng = np.random.default_rng([self.seed, w, index])
        run = _Run(
            w,
            f"{self.workloads[w].label}-{index}",
            int(rng.integers(1 << 62)),
            start_workflow(self.params[w], rng),
            self.now,
        )
        self.runs.append(run)
        self.advance(run)

    def advance(self, run: _Run) -> None:
        try:
            action = next(run.gen)
        except StopIteration:
            run.end = self.now
            return
        if isinstance(action, Delay):
            self.push(self.now + action.seconds, _RESUME, run)
            return
        run.pending = len(action)
        for call in action:
            self.submit(run, call)
            if run.failed:
                return

    def submit(self, run: _Run, call: Call) -> None:
        # the proxy routes a chat call by its prompt; embeddings and rerank bodies carry none
        chat = call.endpoint == "/v1/chat/completions" and len(call.inputs) == 1
        replica = self.router.pick(call.model, run.key, call.inputs[0] if chat else None)
        state = _CallState(next(self.call_counter), run, call, replica, self.now, len(call.inputs))
        run.calls[call.model] = run.calls.get(call.model, 0) + 1
        engine = replica.engine
        rids = []
        try:
            for prompt in call.inputs:
                rid = str(next(self.rid_counter))
                engine.submit(
                    EngineRequest(
                        rid, prompt, call.output_tokens, self.now, run.arrival, call.model
                    )
                )
                rids.append(rid)
        except ValueError:
            for rid in rids:
                engine.abort(rid)
            run.failed = True
            return
        for rid in rids:
            self.inflight[rid] = state
        replica.outstanding += 1
        if replica.stepping:
            self.cut_run(replica)  # the new request joins the step after the current one
        else:
            for peer in replica.peers:  # bandwidth contention changes for co-located peers
                self.cut_run(peer)
            self.start_step(replica)

    # --- engine steps -------------------------------------------------------------------
    def start_step(self, replica: Replica) -> None:
        replica.apply_contention()
        engine = replica.engine
        k = engine.decode_run_length() if self.fast_forward else 0
        if k >= _MIN_RUN:
            # identical decode steps with no event inside: one heap event for all of them
            ends = engine.decode_run_times(k).cumsum()
            replica.macro = (self.now, ends)
            replica.version += 1
            replica.stepping = True
            replica.busy_time += float(ends[-1])
            replica.steps += k
            self.push(self.now + float(ends[-1]), _RUN_END, (replica, replica.version))
            return
        out = engine.step()
        if out.duration <= 0.0 and not out.finished:
            replica.stepping = False  # nothing schedulable (cannot happen for valid requests)
            return
        replica.stepping = True
        replica.busy_time += out.duration
        replica.steps += 1
        self.push(self.now + out.duration, _STEP_END, (replica, out))

    def cut_run(self, replica: Replica) -> None:
        """Something changed for a replica inside a decode run: end the run after the step
        in progress, so that the next step sees the change (exactly as step by step)."""
        if replica.macro is None:
            return
        start, ends = replica.macro
        keep = int(ends.searchsorted(self.now - start, side="right")) + 1
        if keep >= len(ends):
            return
        replica.busy_time -= float(ends[-1] - ends[keep - 1])
        replica.steps -= len(ends) - keep
        replica.macro = (start, ends[:keep])
        replica.version += 1
        self.push(start + float(ends[keep - 1]), _RUN_END, (replica, replica.version))

    def end_run(self, replica: Replica, version: int) -> None:
        if version != replica.version or replica.macro is None:
            return  # superseded by cut_run
        steps = len(replica.macro[1])
        replica.macro = None
        replica.engine.advance_decode(steps)
        self.start_step(replica)  # a run never ends the replica's work

    def end_step(self, replica: Replica, out: StepOutcome) -> None:
        inflight = self.inflight
        for rid in out.first_token:
            state = inflight[rid]
            if state.t_first < 0:
                state.t_first = self.now
            state.cached += out.cached_tokens.get(rid, 0)
        for rid in out.finished:
            state = inflight.pop(rid)
            state.remaining -= 1
            if state.remaining == 0:
                self.finish_call(state)
        if replica.engine.has_work():
            self.start_step(replica)
        else:
            replica.stepping = False
            for peer in replica.peers:
                self.cut_run(peer)

    def finish_call(self, state: _CallState) -> None:
        state.replica.outstanding -= 1
        run = state.run
        if self.record:
            self.trace.append(
                SimCall(
                    state.cid,
                    self.workloads[run.workflow].label,
                    run.rid,
                    state.call,
                    state.replica.name,
                    state.t_start,
                    state.t_first,
                    self.now,
                    state.cached,
                )
            )
        run.pending -= 1
        if run.pending == 0 and not run.failed:
            self.advance(run)

    def open_calls(self) -> list[SimCall]:
        """The calls in flight now, each once, in start order; ``t_first`` and ``t_end`` are
        -1 (what the proxy would announce as open rows)."""
        states = sorted(
            {s.cid: s for s in self.inflight.values()}.values(), key=lambda s: (s.t_start, s.cid)
        )
        return [
            SimCall(
                s.cid,
                self.workloads[s.run.workflow].label,
                s.run.rid,
                s.call,
                s.replica.name,
                s.t_start,
                -1.0,
                -1.0,
                0,
            )
            for s in states
        ]

    # --- the loop -----------------------------------------------------------------------
    def run(self, horizon: float, n_requests: int | None, drain_s: float) -> float:
        """Simulate; return the end of the arrival window."""
        total_rate = sum(w.rate for w in self.workloads)
        if total_rate <= 0:
            raise ValueError("at least one workload needs a positive rate")
        arrivals = [0] * len(self.workloads)
        arrival_rng = np.random.default_rng([self.seed, 1 << 30])
        for w, spec in enumerate(self.workloads):
            if spec.rate > 0:
                self.push(float(arrival_rng.exponential(1.0 / spec.rate)), _ARRIVAL, w)
        started = 0
        window_end = horizon
        deadline = math.inf
        heap = self.heap
        while heap:
            t, _, kind, payload = heapq.heappop(heap)
            if t > deadline:
                break
            self.now = t
            self.events += 1
            if kind == _STEP_END:
                self.end_step(*payload)
            elif kind == _RUN_END:
                self.end_run(*payload)
            elif kind == _CONTROL:
                payload()
            elif kind == _ARRIVAL:
                if t >= horizon or (n_requests is not None and started >= n_requests):
                    if deadline == math.inf:
                        window_end = min(t, horizon)
                        deadline = window_end + drain_s
                    continue
                w = payload
                self.start_run(w, arrivals[w])
                arrivals[w] += 1
                started += 1
                self.push(
                    t + float(arrival_rng.exponential(1.0 / self.workloads[w].rate)), _ARRIVAL, w
                )
            else:
                self.advance(payload)
        return window_end


@dataclass(frozen=True)
class RequestSpan:
    """One workflow request of a run: arrival and end (simulated s; ``end`` is -1 while it
    was still running when the run stopped)."""

    workflow: str
    arrival: float
    end: float
    failed: bool


def simulate(
    allocation: Allocation,
    workloads: Sequence[WorkloadSpec],
    *,
    duration_s: float | None = None,
    n_requests: int | None = None,
    seed: int = 0,
    warmup_s: float = 0.0,
    drain_s: float = 600.0,
    routing: RoutingPolicy = "prefix_affinity",
    record_calls: bool = False,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    enable_prefix_caching: bool = True,
    scheduling: Literal["fcfs", "priority"] = "fcfs",
    fast_forward: bool = True,
) -> SimResult:
    """Simulate ``workloads`` on ``allocation`` for ``duration_s`` of arrivals or until
    ``n_requests`` requests have started (whichever comes first; at least one is needed).
    ``fast_forward``: run uneventful decode steps as one event (same results, much faster).
    ``routing``: by default the product proxy's deployed policy (``sim.cluster.Router``).
    ``throughput`` counts completions inside the measurement window ``[warmup_s, end of
    arrivals)``: give a warm-up of about a request's latency for steady-state figures."""
    return simulate_requests(
        allocation,
        workloads,
        duration_s=duration_s,
        n_requests=n_requests,
        seed=seed,
        warmup_s=warmup_s,
        drain_s=drain_s,
        routing=routing,
        record_calls=record_calls,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=enable_prefix_caching,
        scheduling=scheduling,
        fast_forward=fast_forward,
    )[0]


def simulate_requests(
    allocation: Allocation,
    workloads: Sequence[WorkloadSpec],
    *,
    duration_s: float | None = None,
    n_requests: int | None = None,
    seed: int = 0,
    warmup_s: float = 0.0,
    drain_s: float = 600.0,
    routing: RoutingPolicy = "prefix_affinity",
    record_calls: bool = False,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    enable_prefix_caching: bool = True,
    scheduling: Literal["fcfs", "priority"] = "fcfs",
    fast_forward: bool = True,
) -> tuple[SimResult, tuple[RequestSpan, ...]]:
    """:func:`simulate`, plus every request's span in arrival order (for backlog trends and
    per-request statistics that the summary does not keep)."""
    if duration_s is None and n_requests is None:
        raise ValueError("give duration_s or n_requests")
    wall = time.perf_counter()
    sim = Simulation(
        allocation,
        workloads,
        seed,
        routing,
        record_calls,
        fast_forward,
        {
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": max_num_seqs,
            "enable_prefix_caching": enable_prefix_caching,
            "scheduling": scheduling,
        },
    )
    horizon = duration_s if duration_s is not None else math.inf
    window_end = sim.run(horizon, n_requests, drain_s)
    if window_end == math.inf:  # the arrivals never stopped: n_requests not reached
        window_end = sim.now
    spans = tuple(
        RequestSpan(sim.workloads[r.workflow].label, r.arrival, r.end, r.failed) for r in sim.runs
    )
    return _result(sim, warmup_s, window_end, time.perf_counter() - wall), spans


def _result(sim: Simulation, warmup_s: float, window_end: float, wall_s: float) -> SimResult:
    span = max(window_end - warmup_s, 1e-9)
    workflows: dict[str, WorkflowResult] = {}
    for w, spec in enumerate(sim.workloads):
        measured = [r for r in sim.runs if r.workflow == w and warmup_s <= r.arrival < window_end]
        done = [r for r in measured if r.end >= 0 and not r.failed]
        in_window = sum(
            1
            for r in sim.runs
            if r.workflow == w and r.end >= 0 and not r.failed and warmup_s <= r.end <= window_end
        )
        calls: dict[str, float] = {}
        for r in done:
            for model, n in r.calls.items():
                calls[model] = calls.get(model, 0.0) + n
        workflows[spec.label] = WorkflowResult(
            spec.label,
            spec.rate,
            len(measured),
            len(done),
            len(measured) - len(done),
            in_window / span,
            LatencyStats.of([r.end - r.arrival for r in done]),
            {m: n / len(done) for m, n in sorted(calls.items())} if done else {},
        )
    end = max(sim.now, 1e-9)
    replicas = tuple(
        ReplicaResult(
            r.name,
            r.spec.model,
            r.gpus,
            r.spec.share,
            r.busy_time / end,
            r.steps,
            r.engine.preemptions_total,
            r.engine.prefix_cache_hits / max(1, r.engine.prefix_cache_queries),
        )
        for r in sim.replicas
    )
    return SimResult(
        LABEL,
        sim.seed,
        sim.now,
        wall_s,
        sim.events,
        (warmup_s, window_end),
        workflows,
        replicas,
        tuple(sim.trace),
    )
