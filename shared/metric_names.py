"""Prometheus metric names every box exports (DESIGN §3.9): one place, so that dashboards and
their test can check each query against what the code really exports.

Conventions: ``scepsy_proxy_*`` / ``scepsy_optimizer_*``, seconds as the unit, ``_total`` on
counters; labels among ``workflow``, ``model``, ``upstream``, ``code``.
"""

from __future__ import annotations

PROXY_REQUESTS = "scepsy_proxy_requests_total"
PROXY_REQUEST_DURATION = "scepsy_proxy_request_duration_seconds"
PROXY_TTFB = "scepsy_proxy_time_to_first_byte_seconds"
PROXY_PROMPT_TOKENS = "scepsy_proxy_prompt_tokens_total"
PROXY_COMPLETION_TOKENS = "scepsy_proxy_completion_tokens_total"
PROXY_IN_FLIGHT = "scepsy_proxy_upstream_in_flight"
PROXY_UPSTREAM_ERRORS = "scepsy_proxy_upstream_errors_total"
PROXY_RETRIES = "scepsy_proxy_retries_total"
PROXY_EJECTIONS = "scepsy_proxy_upstream_ejections_total"
PROXY_REPLICAS = "scepsy_proxy_replicas"
PROXY_QUEUE_DEPTH = "scepsy_proxy_recorder_queue_depth"
PROXY_RECORDS_WRITTEN = "scepsy_proxy_records_written_total"
PROXY_RECORDS_DROPPED = "scepsy_proxy_records_dropped_total"
PROXY_SEGMENTS_WRITTEN = "scepsy_proxy_segments_written_total"

PROXY_METRICS: tuple[str, ...] = (
    PROXY_REQUESTS,
    PROXY_REQUEST_DURATION,
    PROXY_TTFB,
    PROXY_PROMPT_TOKENS,
    PROXY_COMPLETION_TOKENS,
    PROXY_IN_FLIGHT,
    PROXY_UPSTREAM_ERRORS,
    PROXY_RETRIES,
    PROXY_EJECTIONS,
    PROXY_REPLICAS,
    PROXY_QUEUE_DEPTH,
    PROXY_RECORDS_WRITTEN,
    PROXY_RECORDS_DROPPED,
    PROXY_SEGMENTS_WRITTEN,
)
