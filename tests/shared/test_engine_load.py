"""Reading an engine's /metrics page: both dialects' load figures, and nothing raised on junk."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.engine_load import EngineLoad, engine_load, first_samples

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 7.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B"} 5.0
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 3.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.5
vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="m"} 12.0
"""

SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",tp_rank="0"} 12
sglang:num_queue_reqs{model_name="qwen",tp_rank="0"} 4
sglang:token_usage{model_name="qwen",tp_rank="0"} 0.97
"""


def test_vllm_data_parallel_ranks_are_summed() -> None:
    assert engine_load(VLLM) == EngineLoad(running=12.0, waiting=3.0, kv_usage=0.75)


def test_sglang_names_read_the_same_figures() -> None:
    load = engine_load(SGLANG)
    assert load == EngineLoad(running=12.0, waiting=4.0, kv_usage=0.97)
    assert load is not None and load.calls == 16.0


def test_older_vllm_cache_name_and_missing_figures() -> None:
    old = "vllm:num_requests_waiting 2\nvllm:gpu_cache_usage_perc 0.1\n"
    assert engine_load(old) == EngineLoad(running=0.0, waiting=2.0, kv_usage=0.1)
    assert engine_load("vllm:kv_cache_usage_perc 0.3\n") is None  # no calls named: no load
    assert engine_load("<html>not metrics</html>") is None


def test_first_samples_keep_the_first_series_and_skip_bad_lines() -> None:
    page = 'a{x="1 2"} 3 1700000000\na{x="2"} 4\nb nope\n# c 5\nd 6\n'
    assert first_samples(page) == {"a": 3.0, "d": 6.0}


def test_negative_and_nan_figures_are_ignored() -> None:
    assert engine_load("vllm:num_requests_running NaN\nvllm:num_requests_waiting -4\n") is None


@given(st.text(max_size=400))
def test_any_page_reads_without_raising(page: str) -> None:
    load = engine_load(page)
    assert load is None or (load.running >= 0 and load.waiting >= 0)
    first_samples(page)
