"""The proxy's per-call metrics: tallied as plain numbers, exposed exactly as the Prometheus
client's own ``Counter`` and ``Histogram`` would expose the same calls (less ``_created``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics import _BUCKETS, ProxyMetrics
from proxy.recorder import Recorder
from proxy.router import Router
from shared import metric_names as names
from shared.records import CallRecord
from shared.settings import RoutingSettings, StoreSettings

pytestmark = pytest.mark.timeout(60)

_CALL = st.tuples(
    st.sampled_from(["beam", "rag", None]),
    st.sampled_from(["llama", "e5"]),
    st.sampled_from([200, 400, 502]),
    st.one_of(st.none(), st.integers(0, 400_000_000)),  # duration, µs
    st.one_of(st.none(), st.integers(0, 2_000_000)),  # first byte, µs
    st.one_of(st.none(), st.integers(0, 5000)),
    st.one_of(st.none(), st.integers(0, 5000)),
)


def _metrics() -> ProxyMetrics:
    # never started: the recorder writes nothing, its counters read zero
    return ProxyMetrics(Router(RoutingSettings(), []), Recorder(StoreSettings(), "proxy"))


def _samples(page: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Each sample of the families the tally replaces, keyed by name and sorted labels."""
    ours = (
        names.PROXY_REQUESTS.removesuffix("_total"),
        names.PROXY_REQUEST_DURATION,
        names.PROXY_TTFB,
        names.PROXY_PROMPT_TOKENS.removesuffix("_total"),
        names.PROXY_COMPLETION_TOKENS.removesuffix("_total"),
    )
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page.decode())
        if family.name in ours
        for s in family.samples
        if not s.name.endswith("_created")
    }


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(_CALL, max_size=40), rejected=st.lists(st.sampled_from([400, 401, 404])))
def test_the_tally_exposes_what_the_client_library_would(
    calls: list[tuple[str | None, str, int, int | None, int | None, int | None, int | None]],
    rejected: list[int],
) -> None:
    metrics = _metrics()
    ref = CollectorRegistry()
    requests = Counter(names.PROXY_REQUESTS, "", ["workflow", "model", "code"], registry=ref)
    duration = Histogram(
        names.PROXY_REQUEST_DURATION, "", ["workflow", "model"], buckets=_BUCKETS, registry=ref
    )
    ttfb = Histogram(names.PROXY_TTFB, "", ["workflow", "model"], buckets=_BUCKETS, registry=ref)
    prompt = Counter(names.PROXY_PROMPT_TOKENS, "", ["workflow", "model"], registry=ref)
    completion = Counter(names.PROXY_COMPLETION_TOKENS, "", ["workflow", "model"], registry=ref)
    for wf, model, status, took, first, p, c in calls:
        rec = CallRecord("id", "proxy", wf, None, model, "/v1/chat/completions", t_start=10)
        rec.t_end = None if took is None else 10 + took
        rec.t_first_byte = None if first is None else 10 + first
        rec.prompt_tokens, rec.completion_tokens = p, c
        metrics.observe(rec, status)
        labels = (wf or "", model)
        requests.labels(*labels, str(status)).inc()
        if took is not None:
            duration.labels(*labels).observe(took / 1e6)
        if first is not None:
            ttfb.labels(*labels).observe(first / 1e6)
        else:
            ttfb.labels(*labels)  # the series exists once its call was seen
        if took is None:
            duration.labels(*labels)
        prompt.labels(*labels).inc(p or 0)
        completion.labels(*labels).inc(c or 0)
    for status in rejected:
        metrics.rejected(status)
        requests.labels("", "", str(status)).inc()
    got, want = _samples(generate_latest(metrics.registry)), _samples(generate_latest(ref))
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


def test_a_value_on_a_bucket_bound_counts_in_that_bucket() -> None:
    metrics = _metrics()
    rec = CallRecord("id", "proxy", "wf", None, "m", "/v1/completions", t_start=0)
    rec.t_end = 250_000  # 0.25 s: a bound itself (le="0.25" holds it, le="0.1" does not)
    metrics.observe(rec, 200)
    page = _samples(generate_latest(metrics.registry))
    bucket = names.PROXY_REQUEST_DURATION + "_bucket"
    assert page[(bucket, (("le", "0.25"), ("model", "m"), ("workflow", "wf")))] == 1
    assert page[(bucket, (("le", "0.1"), ("model", "m"), ("workflow", "wf")))] == 0
