"""The proxy's Prometheus metrics (names in ``shared.metric_names``), on a per-app registry.

Role: one :class:`ProxyMetrics` per app. Per-call figures are observed once per finished call
(:meth:`ProxyMetrics.observe`); state that already lives elsewhere (in-flight calls per replica,
recorder depth and counters) is read at scrape time by a collector instead of being mirrored
on the hot path.

Invariants: a call's figures (status count, duration and first-byte histograms, tokens) are
plain numbers added on the event loop's thread (:class:`_Tally`: a few dict lookups and int
additions, no lock, no label validation), made the same Prometheus families the client
library's ``Counter`` and ``Histogram`` would expose (less their ``_created`` samples) only
when scraped; the registry is private to the app, so several proxies (and tests) in one
process never collide.

The ``workflow`` label is bounded: clients choose workflow names, and each new one would be a
new series forever (5,000 ids made a 21 MB /metrics). The first ``max_workflows`` names seen,
plus those the settings name, keep their own label; every later one is counted as
:data:`OTHER`. A name is admitted once, so the check is one dict lookup per call; admitted names
are made valid UTF-8 (a client's undecodable bytes reach us as lone surrogates, which the
exposition could not encode) and cut to :data:`MAX_LABEL_CHARS`.

:class:`AccessLoggingMetrics` adds the access log (``proxy.access_log``) by overriding
:meth:`ProxyMetrics.observe`: with the log off the plain class runs, at no cost per call.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from proxy.recorder import Recorder
from proxy.router import Router
from shared import metric_names as names
from shared.records import CallRecord

OTHER = "other"  # the workflow label of every name past the first max_workflows
MAX_LABEL_CHARS = 200
access_log = logging.getLogger("scepsy.proxy.access")


def label_value(text: str) -> str:
    """``text`` as a label value /metrics can always encode: valid UTF-8, bounded length."""
    return text[:MAX_LABEL_CHARS].encode("utf-8", "replace").decode("utf-8")


# Latency buckets from sub-millisecond (embeddings through a fast proxy) to long generations.
_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)


class _StateCollector(Collector):
    def __init__(self, router: Router, recorder: Recorder) -> None:
        self._router = router
        self._recorder = recorder

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            names.PROXY_IN_FLIGHT, "Calls in flight per replica", labels=["model", "upstream"]
        )
        replicas = GaugeMetricFamily(
            names.PROXY_REPLICAS, "Replicas per model and state", labels=["model", "state"]
        )
        counts: dict[tuple[str, str], int] = {}
        for rep in self._router.replicas():
            in_flight.add_metric([rep.model, rep.url], rep.in_flight)
            state = str(rep.describe()["state"])
            counts[(rep.model, state)] = counts.get((rep.model, state), 0) + 1
        for (model, state), n in counts.items():
            replicas.add_metric([model, state], n)
        rec = self._recorder
        depth = GaugeMetricFamily(names.PROXY_QUEUE_DEPTH, "Call records not yet on disk")
        depth.add_metric([], rec.depth)
        written = CounterMetricFamily(
            names.PROXY_RECORDS_WRITTEN.removesuffix("_total"), "Call records written to the store"
        )
        written.add_metric([], rec.written)
        dropped = CounterMetricFamily(
            names.PROXY_RECORDS_DROPPED.removesuffix("_total"),
            "Call records dropped (queue full or store failing)",
        )
        dropped.add_metric([], rec.dropped)
        segments = CounterMetricFamily(
            names.PROXY_SEGMENTS_WRITTEN.removesuffix("_total"), "Parquet segments written"
        )
        segments.add_metric([], rec.segments)
        quarantined = CounterMetricFamily(
            names.PROXY_RECORDS_QUARANTINED.removesuffix("_total"),
            "Call records the store refused, kept in <store>/quarantine, by reason",
            labels=["reason"],
        )
        for reason, n in rec.quarantined.items():
            quarantined.add_metric([reason[:200]], n)
        replayed = CounterMetricFamily(
            names.PROXY_RECORDS_REPLAYED.removesuffix("_total"),
            "Call records a killed proxy had journaled, written at this proxy's start",
        )
        replayed.add_metric([], rec.replayed)
        yield from (in_flight, replicas, depth, written, dropped, segments, quarantined, replayed)


class _Tally:
    """The per-call figures of one ``(workflow, model)``: plain numbers, made Prometheus
    families only when scraped. Histogram counts are per bucket (the last: above every
    bound), made cumulative at scrape time."""

    __slots__ = ("completion", "duration", "duration_sum", "prompt", "ttfb", "ttfb_sum")

    def __init__(self) -> None:
        self.duration = [0] * (len(_BUCKETS) + 1)
        self.duration_sum = 0.0
        self.ttfb = [0] * (len(_BUCKETS) + 1)
        self.ttfb_sum = 0.0
        self.prompt = 0
        self.completion = 0


# the ``le`` label of each bucket, as the client library writes it ("1.0", "+Inf")
_LE = (*(repr(float(b)) for b in _BUCKETS), "+Inf")


def _buckets(counts: list[int]) -> list[tuple[str, float]]:
    """Per-bucket counts as the cumulative ``le`` buckets of the exposition."""
    out, total = [], 0
    for le, n in zip(_LE, counts, strict=True):
        total += n
        out.append((le, float(total)))
    return out


class _CallCollector(Collector):
    """The per-call families (requests, duration, first byte, tokens) from their tallies:
    the same names, types and labels the client library's own metrics would expose."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        requests = CounterMetricFamily(
            names.PROXY_REQUESTS.removesuffix("_total"),
            "Calls answered, by status code",
            labels=["workflow", "model", "code"],
        )
        for (wf, model, code), n in m.answered.items():
            requests.add_metric([wf, model, str(code)], n)
        duration = HistogramMetricFamily(
            names.PROXY_REQUEST_DURATION,
            "Call duration seen by the proxy",
            labels=["workflow", "model"],
        )
        ttfb = HistogramMetricFamily(
            names.PROXY_TTFB,
            "Time to the upstream's first response byte",
            labels=["workflow", "model"],
        )
        prompt = CounterMetricFamily(
            names.PROXY_PROMPT_TOKENS.removesuffix("_total"),
            "Prompt tokens (engine usage)",
            labels=["workflow", "model"],
        )
        completion = CounterMetricFamily(
            names.PROXY_COMPLETION_TOKENS.removesuffix("_total"),
            "Completion tokens (engine usage)",
            labels=["workflow", "model"],
        )
        for (wf, model), t in m.tallies.items():
            duration.add_metric([wf, model], _buckets(t.duration), t.duration_sum)
            ttfb.add_metric([wf, model], _buckets(t.ttfb), t.ttfb_sum)
            prompt.add_metric([wf, model], t.prompt)
            completion.add_metric([wf, model], t.completion)
        yield from (requests, duration, ttfb, prompt, completion)


class ProxyMetrics:
    def __init__(
        self,
        router: Router,
        recorder: Recorder,
        *,
        max_workflows: int = 50,
        known_workflows: Iterable[str] = (),
    ) -> None:
        # Raw workflow name → its label; "" is calls without a workflow (and rejected calls).
        self._workflows: dict[str, str] = {"": ""}
        for name in known_workflows:
            self._workflows[name] = label_value(name)
        self._workflow_room = max_workflows
        # Per-call figures as plain numbers (a call adds to a few ints, no lock, no child
        # lookup), read by _CallCollector; only the event loop's thread touches them.
        self.answered: dict[tuple[str, str, int], int] = {}
        self.tallies: dict[tuple[str, str], _Tally] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        r.register(_CallCollector(self))
        self.upstream_errors = Counter(
            names.PROXY_UPSTREAM_ERRORS,
            "Upstream failures: connect, timeout, disconnect, or HTTP status",
            ["model", "upstream", "code"],
            registry=r,
        )
        self.retries = Counter(
            names.PROXY_RETRIES, "Calls retried on another replica", ["model"], registry=r
        )
        self.ejections = Counter(
            names.PROXY_EJECTIONS,
            "Replicas ejected after repeated failures",
            ["model", "upstream"],
            registry=r,
        )
        r.register(_StateCollector(router, recorder))
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def workflow_label(self, workflow: str | None) -> str:
        """The ``workflow`` label value of a call: its own name while fewer than
        ``max_workflows`` names have been admitted (or the settings name it), else ``other``."""
        name = workflow or ""
        label = self._workflows.get(name)
        if label is None:
            if self._workflow_room <= 0:
                return OTHER
            self._workflow_room -= 1
            label = self._workflows[name] = label_value(name)
        return label

    @property
    def workflow_labels(self) -> int:
        """Distinct workflow names with a label of their own (the bound's test reads it)."""
        return len(self._workflows)

    def observe(self, rec: CallRecord, status: int) -> None:
        """One finished logical call (its last attempt)."""
        model = rec.model
        wf = self._workflows.get(rec.workflow or "")
        if wf is None:
            wf = self.workflow_label(rec.workflow)
        key = (wf, model, status)
        self.answered[key] = self.answered.get(key, 0) + 1
        t = self.tallies.get((wf, model))
        if t is None:
            t = self.tallies[(wf, model)] = _Tally()
        if rec.t_end is not None:
            seconds = (rec.t_end - rec.t_start) / 1e6
            t.duration[bisect_left(_BUCKETS, seconds)] += 1  # le: a bound holds itself
            t.duration_sum += seconds
        if rec.t_first_byte is not None:
            seconds = (rec.t_first_byte - rec.t_start) / 1e6
            t.ttfb[bisect_left(_BUCKETS, seconds)] += 1
            t.ttfb_sum += seconds
        if rec.prompt_tokens:
            t.prompt += rec.prompt_tokens
        if rec.completion_tokens:
            t.completion += rec.completion_tokens

    def rejected(self, status: int) -> None:
        """A call refused before it had a model and workflow (bad body, auth, unknown route)."""
        key = ("", "", status)
        self.answered[key] = self.answered.get(key, 0) + 1

    def upstream_error(self, model: str, upstream: str, code: str) -> None:
        self._child(self.upstream_errors, model, upstream, code).inc()


class AccessLoggingMetrics(ProxyMetrics):
    """:class:`ProxyMetrics` that also logs each finished call on ``scepsy.proxy.access``
    (``proxy.access_log``): method, path, status, model, workflow, upstream, duration_ms."""

    def observe(self, rec: CallRecord, status: int) -> None:
        super().observe(rec, status)
        duration_ms = None if rec.t_end is None else round((rec.t_end - rec.t_start) / 1e3, 1)
        access_log.info(
            "POST %s %d model=%s workflow=%s upstream=%s duration_ms=%s",
            rec.endpoint,
            status,
            rec.model,
            rec.workflow or "-",
            rec.upstream or "-",
            duration_ms,
            extra={
                "method": "POST",
                "path": rec.endpoint,
                "status": status,
                "model": rec.model,
                "workflow": rec.workflow,
                "upstream": rec.upstream,
                "duration_ms": duration_ms,
            },
        )


# Families whose samples every worker reports alike (the route table's replica counts): merged
# by maximum, not summed. ``*_created`` samples (a series' start time) merge by minimum.
_SAME_IN_EVERY_WORKER = frozenset({names.PROXY_REPLICAS})


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def merge_expositions(pages: Iterable[bytes]) -> bytes:
    """Several workers' ``/metrics`` pages as one: each series' samples summed (counters,
    histograms, in-flight and queue gauges are per-worker shares of one total), except the
    families in ``_SAME_IN_EVERY_WORKER`` (maximum) and ``*_created`` (minimum). Families keep
    the order and HELP/TYPE lines of their first appearance; a worker's workflow-label bound
    is its own, so the merged page may hold up to workers x ``max_workflows`` names."""
    families: dict[str, tuple[list[str], dict[str, float]]] = {}
    for page in pages:
        family = ""
        for line in page.decode("utf-8", "replace").splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                headers, _ = families.setdefault(family, ([], {}))
                if line not in headers and len(headers) < 2:
                    headers.append(line)
                continue
            if not line or line.startswith("#"):
                continue
            close = line.rfind("}")
            cut = line.find(" ", close + 1 if close >= 0 else 0)
            if cut < 0:
                continue
            key, value_text = line[:cut], line[cut + 1 :].split(" ", 1)[0]
            try:
                value = float(value_text)
            except ValueError:
                continue
            samples = families.setdefault(family, ([], {}))[1]
            if key not in samples:
                samples[key] = value
            elif key.partition("{")[0].endswith("_created"):
                samples[key] = min(samples[key], value)
            elif family in _SAME_IN_EVERY_WORKER:
                samples[key] = max(samples[key], value)
            else:
                samples[key] += value
    out: list[str] = []
    for headers, samples in families.values():
        out.extend(headers)
        out.extend(f"{key} {_number(value)}" for key, value in samples.items())
    return ("\n".join(out) + "\n").encode()
