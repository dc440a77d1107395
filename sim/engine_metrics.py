"""Prometheus metrics of one emulated engine, under vLLM V1's names.

Role: expose ``GET /metrics`` the way a vLLM server does (``vllm:`` names, label
``model_name``), so the proxy and the optimizer scrape an emulator exactly as they would scrape
vLLM, plus ``scepsy_emulator_*`` series that say how faithfully the emulator keeps its clock.

Invariants: one ``CollectorRegistry`` per app (never the process-global one, so several
emulators live in one process); gauges and counters owned by the engine core are read at
scrape time, never copied; latency histograms are in model seconds (wall x speed-up), i.e. what
the emulated GPU's engine would have measured.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sim.engine_driver import EngineDriver, Ticket

# vLLM V1's bucket boundaries (vllm/v1/metrics/loggers.py), so dashboards line up.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def _read(core: Any, name: str) -> float:
    """A core counter, whether the core exposes it as an attribute, a property or a method."""
    value = getattr(core, name, 0)
    return float(value() if callable(value) else value)


class _EngineCollector(Collector):
    """Reads the core's and the driver's state at scrape time."""

    def __init__(self, model_name: str, driver: EngineDriver) -> None:
        self._model = model_name
        self._driver = driver

    def collect(self) -> Iterator[Metric]:
        core, labels = self._driver.core, [self._model]
        for name, doc, attr in (
            (
                "vllm:num_requests_running",
                "Requests in the running batch (emulated).",
                "num_running",
            ),
            (
                "vllm:num_requests_waiting",
                "Requests waiting to be scheduled (emulated).",
                "num_waiting",
            ),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full (emulated).", "kv_usage"),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(labels, _read(core, attr))
            yield gauge
        for name, doc, attr in (
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                "prefix_cache_queries",
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                "prefix_cache_hits",
            ),
            ("vllm:prompt_tokens", "Prefill tokens processed.", "prompt_tokens_total"),
            ("vllm:generation_tokens", "Generation tokens processed.", "generation_tokens_total"),
            ("vllm:num_preemptions", "Cumulative preemptions.", "preemptions_total"),
        ):
            counter = CounterMetricFamily(name, doc + " (emulated)", labels=["model_name"])
            counter.add_metric(labels, _read(core, attr))
            yield counter
        drv = self._driver
        lag = GaugeMetricFamily(
            "scepsy_emulator_clock_lag_ratio",
            "Wall time the emulator lost against its model clock over recent wall time, idle "
            "included (0 = exact, 0.05 = clock 5% behind).",
            labels=["model_name"],
        )
        lag.add_metric(labels, drv.lag_ratio)
        yield lag
        stretch = GaugeMetricFamily(
            "scepsy_emulator_step_stretch_ratio",
            "Recent busy steps' wall time over the wall time the model asked for, minus 1.",
            labels=["model_name"],
        )
        stretch.add_metric(labels, drv.step_stretch)
        yield stretch
        lost = CounterMetricFamily(
            "scepsy_emulator_lost_wall_seconds",
            "Wall seconds steps took beyond what the model asked for.",
            labels=["model_name"],
        )
        lost.add_metric(labels, drv.lost_wall_s)
        yield lost
        speed = GaugeMetricFamily(
            "scepsy_emulator_speedup", "Model seconds per wall second.", labels=["model_name"]
        )
        speed.add_metric(labels, drv.speedup)
        yield speed
        busy = CounterMetricFamily(
            "scepsy_emulator_model_busy_seconds",
            "Model seconds of engine steps run.",
            labels=["model_name"],
        )
        busy.add_metric(labels, drv.model_busy_s)
        yield busy
        steps = CounterMetricFamily(
            "scepsy_emulator_steps", "Engine steps run.", labels=["model_name"]
        )
        steps.add_metric(labels, float(drv.steps_total))
        yield steps


class EngineMetrics:
    """The registry of one emulated engine; ``observe`` is called once per finished request."""

    def __init__(self, model_name: str, driver: EngineDriver) -> None:
        self.model_name = model_name
        self.driver = driver
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(model_name, driver))
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token in model seconds (emulated).",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in model seconds (emulated).",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason (emulated).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    def observe(self, ticket: Ticket) -> None:
        """Record a finished engine request's latencies (driver callback)."""
        if ticket.first_at is None or ticket.finished_at is None:
            return
        self.ttft.labels(self.model_name).observe(
            self.driver.model_seconds(ticket.first_at - ticket.arrival)
        )
        self.e2e.labels(self.model_name).observe(
            self.driver.model_seconds(ticket.finished_at - ticket.arrival)
        )

    def count_finished(self, reason: str) -> None:
        self.success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
