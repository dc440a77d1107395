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
PROXY_RECORDS_QUARANTINED = "scepsy_proxy_records_quarantined_total"
PROXY_RECORDS_REPLAYED = "scepsy_proxy_records_replayed_total"

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
    PROXY_RECORDS_QUARANTINED,
    PROXY_RECORDS_REPLAYED,
)

# Optimizer daemon (DESIGN §3.8-3.9). Gauges unless the name ends in _total or _seconds
# (search duration is a histogram). Labels: workflow, model; code on counters.
OPTIMIZER_WORKFLOW_RATE = "scepsy_optimizer_workflow_rate"  # λ_w, requests/s (workflow)
OPTIMIZER_CALLS_PER_REQUEST = "scepsy_optimizer_calls_per_request"  # n_m (workflow, model)
OPTIMIZER_PARALLELISM = "scepsy_optimizer_parallelism"  # p_m (workflow, model)
OPTIMIZER_PREDICTED_LATENCY = "scepsy_optimizer_predicted_latency_seconds"  # L_w (workflow)
OPTIMIZER_OBSERVED_LATENCY = "scepsy_optimizer_observed_latency_seconds"  # (workflow)
OPTIMIZER_ALLOCATED_SHARE = "scepsy_optimizer_allocated_gpu_share"  # GPU-equivalents (model)
OPTIMIZER_REPLICAS = "scepsy_optimizer_replicas"  # replicas allocated (model)
OPTIMIZER_ROLLOUTS = "scepsy_optimizer_rollouts_total"  # code: ok, failed
OPTIMIZER_ROLLOUT_DURATION = "scepsy_optimizer_rollout_duration_seconds"  # histogram
OPTIMIZER_SEARCH_DURATION = "scepsy_optimizer_search_duration_seconds"  # histogram
OPTIMIZER_DECISIONS = "scepsy_optimizer_decisions_total"  # code: the decision's reason
# Trace-store segments the readers skip as unreadable (truncated, corrupt): a gauge.
OPTIMIZER_UNREADABLE_SEGMENTS = "scepsy_optimizer_store_unreadable_segments"
# Live profile points (learned from the replicas' traffic) the profile book holds (model).
OPTIMIZER_LIVE_PROFILE_POINTS = "scepsy_optimizer_live_profile_points"
# Profiling runs the daemon started on its own (reason: no_profile, uncovered, drift;
# outcome: started, ok, failed, cancelled, waiting) and whether one runs now (0 or 1).
OPTIMIZER_REPROFILES = "scepsy_optimizer_reprofiles_total"
OPTIMIZER_REPROFILE_RUNNING = "scepsy_optimizer_reprofile_running"

OPTIMIZER_METRICS: tuple[str, ...] = (
    OPTIMIZER_WORKFLOW_RATE,
    OPTIMIZER_CALLS_PER_REQUEST,
    OPTIMIZER_PARALLELISM,
    OPTIMIZER_PREDICTED_LATENCY,
    OPTIMIZER_OBSERVED_LATENCY,
    OPTIMIZER_ALLOCATED_SHARE,
    OPTIMIZER_REPLICAS,
    OPTIMIZER_ROLLOUTS,
    OPTIMIZER_ROLLOUT_DURATION,
    OPTIMIZER_SEARCH_DURATION,
    OPTIMIZER_DECISIONS,
    OPTIMIZER_UNREADABLE_SEGMENTS,
    OPTIMIZER_LIVE_PROFILE_POINTS,
    OPTIMIZER_REPROFILES,
    OPTIMIZER_REPROFILE_RUNNING,
)
