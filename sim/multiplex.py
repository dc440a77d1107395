"""Multi-model GPU pooling (Aegaeon-style): whole-GPU instances that switch between models.

Role: the simulator's model of Aegaeon (SOSP'25) as the Scepsy paper ran it (§7.2, Fig. 7):
every GPU is an *instance* that can serve any model of the workload, one model at a time, and
switches model (auto-scaling at token granularity) when another model's calls wait. Serving is
disaggregated: per node, ``prefill`` instances run prompts (and the whole of embedding and
rerank calls, which are prefill-only, and of calls that emit one token, such as the
process-reward verifier's), and ``decode`` instances run the rest of generation; a prompt's KV
moves from its prefill instance to a decode instance over the interconnect. Nothing has a
prefix cache (Aegaeon has none). Requests flow through ``sim.des.Simulation``'s event loop
unchanged: an instance is a ``sim.cluster.Replica`` whose engine is a :class:`PooledEngine`.

Invariants:
- an instance steps one model's ``EngineCore`` at a time, each with the whole GPU's
  ``sim.perf`` model, and a model switch is a step of its own that computes nothing; so an
  instance never serves more than one whole GPU's roofline, and alternating models costs a
  switch each time (:func:`switch_seconds`);
- the active model keeps the GPU while it has work and no other model waits; when another
  waits, it keeps it for a quantum of service (``QUANTUM_S``), then the instance moves on to
  the next model with work, round-robin (Aegaeon's time-sliced multiplexing, simplified);
- each model's KV cache on an instance is sized as if it were alone on the GPU: an inactive
  model's KV waits in host memory, and moving it out and back in is part of the switch;
- a call goes to the instance of its pool (prefill or decode) that already holds its model,
  unless that one has ``AFFINITY_SLACK`` more calls than the least loaded (Aegaeon groups a
  model's requests to avoid switches); ties go to the lowest index (deterministic);
- a model an instance cannot hold (weights over the GPU) is refused with ``ValueError`` when
  the pool is built (``bench.evaluation`` reports it unserved).

Simplified against Aegaeon: no SLO-aware scheduling or preemptive scale-down; the quantum is
fixed rather than derived from SLOs; decode instances admit a handed-over request like any
other (vLLM-style continuous batching); KV transfer is one delay per request, not pipelined
per layer, and does not contend with serving.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from sim.cluster import Allocation, Replica, ReplicaSpec, Router
from sim.des import SimResult, Simulation, WorkloadSpec
from sim.engine import EngineCore, EngineRequest, StepOutcome
from sim.perf import MODELS, perf_model
from sim.workflows import Prompt, models_of

__all__ = ["PooledEngine", "PooledSimulation", "simulate_pooled", "switch_seconds"]

# assumed: Aegaeon keeps every model's weights in pinned host memory and reloads them over
# PCIe 4.0 x16 (32 GB/s peak; ~25 GB/s reached by large pinned copies), reusing the engine's
# runtime so that only weights and KV move (its "component reuse"); a fixed part covers the
# engine state's reset and stream synchronisation.
HOST_LINK_BYTES_PER_S = 25e9
SWITCH_FIXED_S = 0.05  # assumed: Aegaeon reports sub-second switches; the weights dominate
# assumed: prefill -> decode KV transfer over the slower of PCIe peer copies and the nodes'
# 100 Gbps InfiniBand (paper §7.1): 12.5 GB/s.
KV_LINK_BYTES_PER_S = 12.5e9
QUANTUM_S = 0.5  # assumed: service a model keeps while another waits (10x a 1B switch)
AFFINITY_SLACK = 4  # assumed: calls a holder may lead the least loaded instance by


def switch_seconds(model: str, kv_bytes_moved: int = 0) -> float:
    """Seconds an instance spends switching to ``model``: its weights in from host memory,
    plus ``kv_bytes_moved`` of KV swapped (the old model's out, the new model's back in)."""
    moved = MODELS[model].weight_bytes + kv_bytes_moved
    return SWITCH_FIXED_S + moved / HOST_LINK_BYTES_PER_S


class PooledEngine(EngineCore):
    """One whole GPU serving ``models`` one at a time: an ``EngineCore`` per model (no prefix
    cache), the base's own queue unused. ``role="prefill"`` clips generation to the first
    token and keeps the original request for the hand-over (:meth:`take`)."""

    def __init__(
        self,
        gpu: str,
        models: Sequence[str],
        role: Literal["prefill", "decode"],
        *,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
    ) -> None:
        self.engines = {
            m: EngineCore(
                perf_model(m, gpu),
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                enable_prefix_caching=False,
            )
            for m in models
        }
        first = self.engines[models[0]]
        super().__init__(
            first.perf,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=False,
        )
        self.role = role
        self.order = list(models)
        self.active: str | None = None  # the model on the GPU (None: none loaded yet)
        self.used = 0.0  # service the active model had since it was switched in
        self.switches = 0
        self.switch_time = 0.0
        self._handover: dict[str, EngineRequest] = {}

    # --- requests ------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> None:
        engine = self.engines.get(req.model)
        if engine is None:
            raise ValueError(f"{req.model!r} is not served by this instance")
        if self.role == "prefill" and req.output_tokens > 1:
            engine.submit(dataclasses.replace(req, output_tokens=1))
            self._handover[req.rid] = req
        else:
            engine.submit(req)

    def take(self, rid: str) -> EngineRequest | None:
        """The original of a request prefilled here that still has tokens to decode."""
        return self._handover.pop(rid, None)

    def abort(self, rid: str) -> None:
        self._handover.pop(rid, None)
        for engine in self.engines.values():
            engine.abort(rid)

    def has_work(self) -> bool:
        return any(e.has_work() for e in self.engines.values())

    def holds(self, model: str) -> bool:
        """``model`` is on the GPU or has calls queued here."""
        engine = self.engines.get(model)
        return engine is not None and (self.active == model or engine.has_work())

    @property
    def num_running(self) -> int:
        return sum(e.num_running for e in self.engines.values())

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.engines.values())

    # --- scheduling ----------------------------------------------------------------------
    def _others_wait(self) -> bool:
        return any(e.has_work() for m, e in self.engines.items() if m != self.active)

    def _next(self) -> str | None:
        """The next model with work, round-robin after the active one."""
        start = self.order.index(self.active) + 1 if self.active is not None else 0
        for i in range(len(self.order)):
            m = self.order[(start + i) % len(self.order)]
            if self.engines[m].has_work():
                return m
        return None

    def _held_bytes(self, model: str | None) -> int:
        """KV bytes ``model``'s requests hold here (what a switch swaps out or back in)."""
        if model is None:
            return 0
        e = self.engines[model]
        tokens = round(e.kv_usage * e.num_blocks * e.block_size)
        return tokens * MODELS[model].kv_bytes_per_token

    def step(self) -> StepOutcome:
        active = self.engines[self.active] if self.active is not None else None
        others = self._others_wait()
        if active is None or not active.has_work() or (others and self.used >= QUANTUM_S):
            nxt = self._next()
            if nxt is None:
                return StepOutcome(0.0)
            moved = self._held_bytes(self.active) + self._held_bytes(nxt)
            cost = switch_seconds(nxt, moved)
            self.active, self.used = nxt, 0.0
            self.switches += 1
            self.switch_time += cost
            return StepOutcome(cost)  # a step that computes nothing
        if not others:
            self.used = 0.0  # the quantum starts counting once another model waits
        out = active.step()
        self.used += out.duration
        self._sync()
        return out

    def _sync(self) -> None:
        engines = self.engines.values()
        self.preemptions_total = sum(e.preemptions_total for e in engines)
        self.prefix_cache_hits = sum(e.prefix_cache_hits for e in engines)
        self.prefix_cache_queries = sum(e.prefix_cache_queries for e in engines)
        self.generation_tokens_total = sum(e.generation_tokens_total for e in engines)

    # --- fast-forward: only while the active model is alone with work ----------------------
    def decode_run_length(self) -> int:
        if self.active is None or self._others_wait():
            return 0
        return self.engines[self.active].decode_run_length()

    def decode_run_times(self, steps: int) -> NDArray[np.float64]:
        return self._active_engine().decode_run_times(steps)

    def advance_decode(self, steps: int) -> None:
        self._active_engine().advance_decode(steps)  # alone with work: no quantum runs
        self._sync()

    def _active_engine(self) -> EngineCore:
        if self.active is None:
            raise RuntimeError("no model is active on this instance")
        return self.engines[self.active]


class _PoolRouter(Router):
    """Routes a call to the prefill instance that holds its model, within the slack."""

    def pick(self, model: str, request_key: int, prompt: Prompt | None = None) -> Replica:
        return pick_instance(self.by_model[model], model)


def pick_instance(pool: Sequence[Replica], model: str) -> Replica:
    """The least loaded instance of ``pool`` holding ``model``, unless it leads the least
    loaded of all by more than ``AFFINITY_SLACK`` calls (then that one)."""
    least = min(pool, key=lambda r: r.outstanding)
    holders = [r for r in pool if isinstance(r.engine, PooledEngine) and r.engine.holds(model)]
    best = min(holders, key=lambda r: r.outstanding, default=None)
    if best is not None and best.outstanding <= least.outstanding + AFFINITY_SLACK:
        return best
    return least


class PooledSimulation(Simulation):
    """``sim.des.Simulation`` over pooled instances: ``prefill_per_node`` prefill and the
    rest decode instances on every node of ``node_gpus`` GPUs (e.g. 3 on 4: 3P1D)."""

    def __init__(
        self,
        workloads: Sequence[WorkloadSpec],
        gpus: int,
        prefill_per_node: int,
        *,
        node_gpus: int = 4,
        gpu: str = "a6000",
        seed: int = 0,
        record_calls: bool = False,
    ) -> None:
        if gpus % node_gpus or not 0 < prefill_per_node < node_gpus:
            raise ValueError(
                f"{gpus} GPUs in nodes of {node_gpus} with {prefill_per_node} prefill "
                "instances per node: need whole nodes and both roles on each"
            )
        models = list(dict.fromkeys(m for w in workloads for m in models_of(w.resolved())))
        generators = [m for m in models if MODELS[m].kind == "generate"] or models[:1]
        prefill: list[Replica] = []
        decode: list[Replica] = []
        for g in range(gpus):
            is_prefill = g % node_gpus < prefill_per_node
            role: Literal["prefill", "decode"] = "prefill" if is_prefill else "decode"
            served = models if is_prefill else generators
            engine = PooledEngine(gpu, served, role)
            pool = prefill if is_prefill else decode
            name = f"{role}/{len(pool)}"
            pool.append(Replica(name, ReplicaSpec(served[0], gpu), (g,), engine))
        super().__init__(
            Allocation(()),
            workloads,
            seed,
            record_calls=record_calls,
            replicas={m: prefill for m in models},
        )
        self.router = _PoolRouter(self.replicas, "least", self.router.rng)
        self.router.by_model = {m: list(prefill) for m in models}  # calls enter at prefill
        self.replicas += decode  # the router never sees them: calls reach them by hand-over
        self.decode = decode
        self._decode_at: dict[int, Replica] = {}  # call id -> its decode instance
        self._prefilling: dict[int, int] = {}  # call id -> its inputs still in prefill

    def end_step(self, replica: Replica, out: StepOutcome) -> None:
        engine = replica.engine
        if isinstance(engine, PooledEngine) and engine.role == "prefill" and out.finished:
            done = []
            for rid in out.finished:
                req = engine.take(rid)
                if req is None:
                    done.append(rid)
                else:
                    self._hand_over(req)
            out.finished = done
        super().end_step(replica, out)

    def _hand_over(self, req: EngineRequest) -> None:
        """A prompt prefilled: its KV moves to a decode instance, which decodes the rest."""
        state = self.inflight[req.rid]
        cid = state.cid
        target = self._decode_at.get(cid)
        if target is None:
            target = self._decode_at[cid] = pick_instance(self.decode, req.model)
        left = self._prefilling.get(cid, state.remaining) - 1
        self._prefilling[cid] = left
        if left == 0:  # the call has left its prefill instance
            del self._prefilling[cid], self._decode_at[cid]
            state.replica.outstanding -= 1
            state.replica = target
            target.outstanding += 1
        moved = len(req.prompt) * MODELS[req.model].kv_bytes_per_token
        landed = dataclasses.replace(req, prefilled=True)
        self.at(self.now + moved / KV_LINK_BYTES_PER_S, lambda: self._land(target, landed))

    def _land(self, target: Replica, req: EngineRequest) -> None:
        try:
            target.engine.submit(req)
        except ValueError:  # does not fit the decode instance's KV cache: the request fails
            state = self.inflight.pop(req.rid)
            state.run.failed = True
            return
        if target.stepping:
            self.cut_run(target)
        else:
            self.start_step(target)


def simulate_pooled(
    workloads: Sequence[WorkloadSpec],
    gpus: int,
    prefill_per_node: int,
    *,
    duration_s: float,
    seed: int = 0,
    warmup_s: float = 0.0,
    drain_s: float = 600.0,
    node_gpus: int = 4,
    gpu: str = "a6000",
) -> tuple[SimResult, dict[str, Any]]:
    """:func:`sim.des.simulate` for an Aegaeon-style pool (see the module docstring), with
    each instance's model switches and the share of its busy time they took."""
    wall = time.perf_counter()
    sim = PooledSimulation(
        workloads, gpus, prefill_per_node, node_gpus=node_gpus, gpu=gpu, seed=seed
    )
    window_end = sim.run(duration_s, None, drain_s)
    switches: dict[str, Any] = {}
    for r in sim.replicas:
        if isinstance(r.engine, PooledEngine):
            share = r.engine.switch_time / r.busy_time if r.busy_time > 0 else 0.0
            switches[r.name] = {"switches": r.engine.switches, "busy_share": round(share, 3)}
    return sim.result(warmup_s, window_end, time.perf_counter() - wall), switches
