"""The optimizer daemon's Prometheus metrics (names in ``shared.metric_names``), per-app registry.

Role: what the daemon learned and decided, as gauges the Grafana dashboard in ``deploy/grafana/``
queries: per workflow the arrival rate, observed and predicted latency; per (workflow, model)
``n_m`` and ``p_m``; per model the replicas and GPU-equivalents allocated; counters of
decisions (``code`` = the decision's kind) and rollouts (``code`` = ok / failed); histograms of
search and rollout time; the store's segments the readers skip as unreadable; per model the
live profile points the profile book holds (learned from what the replicas served); profiling
runs the daemon started on its own, by reason and outcome, and whether one runs now.

Invariants: the registry belongs to one :class:`DaemonMetrics` (tests and demos may run several
daemons in one process); gauges describing the current state are cleared before each update,
so a workflow or model that disappeared stops being exported instead of freezing at its last
value; seconds are the unit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from optimizer.stats.figures import WorkflowStats
from shared import metric_names as names

__all__ = ["DaemonMetrics"]

_SEARCH_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ROLLOUT_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200)


class DaemonMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rate = Gauge(
            names.OPTIMIZER_WORKFLOW_RATE,
            "Workflow arrival rate over the statistics window (requests/s)",
            ["workflow"],
            registry=r,
        )
        self.calls = Gauge(
            names.OPTIMIZER_CALLS_PER_REQUEST,
            "Mean calls to the model per workflow request (n_m)",
            ["workflow", "model"],
            registry=r,
        )
        self.parallelism = Gauge(
            names.OPTIMIZER_PARALLELISM,
            "Request-level parallelism of the model's calls (p_m)",
            ["workflow", "model"],
            registry=r,
        )
        self.predicted = Gauge(
            names.OPTIMIZER_PREDICTED_LATENCY,
            "Latency the ALP predicts for the running allocation at the observed rate",
            ["workflow"],
            registry=r,
        )
        self.observed = Gauge(
            names.OPTIMIZER_OBSERVED_LATENCY,
            "Observed mean workflow request latency over the window",
            ["workflow"],
            registry=r,
        )
        self.share = Gauge(
            names.OPTIMIZER_ALLOCATED_SHARE,
            "GPU-equivalents allocated to the model (replicas x tp x share)",
            ["model"],
            registry=r,
        )
        self.replicas = Gauge(
            names.OPTIMIZER_REPLICAS, "Replicas allocated to the model", ["model"], registry=r
        )
        self.rollouts = Counter(
            names.OPTIMIZER_ROLLOUTS, "Rollouts carried out, by outcome", ["code"], registry=r
        )
        self.rollout_time = Histogram(
            names.OPTIMIZER_ROLLOUT_DURATION,
            "Time one rollout took",
            buckets=_ROLLOUT_BUCKETS,
            registry=r,
        )
        self.search_time = Histogram(
            names.OPTIMIZER_SEARCH_DURATION,
            "Time one allocation search (with placement) took",
            buckets=_SEARCH_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            names.OPTIMIZER_DECISIONS, "Decisions, by kind", ["code"], registry=r
        )
        self.unreadable_segments = Gauge(
            names.OPTIMIZER_UNREADABLE_SEGMENTS,
            "Trace-store segments skipped as unreadable (truncated or corrupt files; each is "
            "named in a warning)",
            registry=r,
        )
        self.live_points = Gauge(
            names.OPTIMIZER_LIVE_PROFILE_POINTS,
            "Live profile points (observed from the replicas' traffic) the profile book holds",
            ["model"],
            registry=r,
        )

        self.reprofiles = Counter(
            names.OPTIMIZER_REPROFILES,
            "Profiling runs the daemon started on its own, by reason (no_profile, uncovered, "
            "drift) and outcome (started, ok, failed, cancelled, waiting)",
            ["reason", "outcome"],
            registry=r,
        )
        self.reprofile_running = Gauge(
            names.OPTIMIZER_REPROFILE_RUNNING,
            "1 while a profiling replica started by the daemon runs, else 0",
            registry=r,
        )

    def observe_live_points(self, counts: Mapping[str, int]) -> None:
        """Per model, the live profile points the book blends into its curves."""
        self.live_points.clear()
        for model, n in counts.items():
            self.live_points.labels(model).set(n)

    def observe_stats(self, stats: Mapping[str, WorkflowStats]) -> None:
        for gauge in (self.rate, self.observed, self.calls, self.parallelism):
            gauge.clear()
        for name, ws in stats.items():
            self.rate.labels(name).set(ws.arrival_rate)
            if math.isfinite(ws.latency_mean):
                self.observed.labels(name).set(ws.latency_mean)
            for model, ms in ws.models.items():
                self.calls.labels(name, model).set(ms.n)
                p = ms.p_agg if math.isfinite(ms.p_agg) else ms.p
                if math.isfinite(p):
                    self.parallelism.labels(name, model).set(p)

    def observe_allocation(self, replicas: Mapping[str, int], gpus: Mapping[str, float]) -> None:
        """What runs: per model, replicas and GPU-equivalents (Σ tp x share)."""
        self.share.clear()
        self.replicas.clear()
        for model, count in replicas.items():
            self.replicas.labels(model).set(count)
            self.share.labels(model).set(gpus.get(model, 0.0))

    def observe_predicted(self, predicted: Mapping[str, float]) -> None:
        self.predicted.clear()
        for name, latency in predicted.items():
            if math.isfinite(latency):
                self.predicted.labels(name).set(latency)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
