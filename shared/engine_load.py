"""An engine's ``/metrics`` page, read: its samples, and the load figures routing folds in.

Role: one reader of the Prometheus text exposition format for everything that scrapes an
engine: the profiler (emulator clock and busy counters, :func:`first_samples`) and the proxy's
load scraper (:func:`engine_load`: running and waiting calls, KV-cache use). vLLM and SGLang
name the same figures differently (``shared/reference/engine-api.md``); :data:`LOAD_NAMES`
is the one table of both dialects.

Invariants: pure functions of the page's text; a line that is not a sample (comments, blank
lines, malformed values, a page that is not Prometheus text at all) is skipped, never raised
on, so a hostile or broken engine page costs its own figures and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

# figure -> the names engines export it under (vLLM V1, older vLLM, SGLang)
LOAD_NAMES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
}


def samples(text: str) -> Iterator[tuple[str, float]]:
    """``(metric name, value)`` per sample line, labels dropped, in page order."""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, brace, rest = line.partition("{")
        if brace:
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        yield name.strip(), value


def first_samples(text: str) -> dict[str, float]:
    """The first sample of every name (an engine exports one series per name we read)."""
    out: dict[str, float] = {}
    for name, value in samples(text):
        out.setdefault(name, value)
    return out


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine reported at one scrape: calls in its running batch, calls queued, and
    its KV cache's fill (0..1; ``None`` when it exports none)."""

    running: float
    waiting: float
    kv_usage: float | None

    @property
    def calls(self) -> float:
        return self.running + self.waiting


def engine_load(text: str) -> EngineLoad | None:
    """The engine's load from its page, summed over its series (a data-parallel engine exports
    one per rank); ``None`` when the page names neither running nor waiting calls."""
    sums: dict[str, float] = {}
    for name, value in samples(text):
        for figure, names in LOAD_NAMES.items():
            if name in names and math.isfinite(value) and value >= 0:
                sums[figure] = sums.get(figure, 0.0) + value
    if "running" not in sums and "waiting" not in sums:
        return None
    kv = sums.get("kv_usage")
    return EngineLoad(sums.get("running", 0.0), sums.get("waiting", 0.0), kv)
