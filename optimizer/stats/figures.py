"""Workflow statistics: what the recorded calls say about how each workflow uses each LLM.

Role: the first optimizer stage (DESIGN §3.4, paper §4 step 2). Input: the call records of a
time window (the relation ``StoreReader.calls`` returns); output: one frozen
:class:`WorkflowStats` per workflow with, per model, the Aggregate LLM Pipeline inputs ``n_m``
(calls per request) and ``p_m`` (request-level parallelism), and the stability figures the paper
relies on (share of LLM time and its coefficient of variation across requests).

Beyond the paper, per request: the *critical path* (length of the union of every call interval,
whatever the model) against the sum of the per-model unions gives an ``overlap_factor`` (< 1
when calls to different LLMs run at once, so their stage latencies must not simply be added);
per pair of models, the time both run at once (``overlaps``) is what the Aggregate LLM
Pipeline scales with load (:mod:`optimizer.model.alp`); and the gaps inside a request's span that
no call covers give the non-LLM ``tool_time``. A workflow whose requests split into two
populations by share is flagged (``bimodal``).

Tool time beside calls: the records hold LLM calls only, so what an app does while its calls
run (a search beside a fan-out) is in no figure here. Only the part of such a tool that
outlasts the calls shows: a gap right after calls that ran at once, ``tool_time_after_fanout``
(part of ``tool_time``; a tool run after the join leaves the same gap). The ALP adds all of
``tool_time`` as a fixed stage: exact at the traced load, an upper bound under load (longer
calls absorb a tool that ran beside them).

Data flow: :mod:`optimizer.stats.scan` groups the store's calls in DuckDB (retry
de-duplication, per request sums) and hands back compact arrays, with the calls of a hash
sample of each workflow's requests (every request unless there are more than about
``UNION_CALLS_CAP`` calls) sorted for :mod:`optimizer.stats.union`'s interval unions; this
module turns those into per-workflow and per-model figures (vectorised over requests and
(request, model) segments; Python loops only over workflows and models). Exact over every
completed request: requests, arrivals, request latency (mean, CV), and per model the calls,
``n`` and mean call latency. Means over the sample: what needs a request's calls per model
(shares and their CV, ``requests_calling`` scaled up, the bimodality split) and the unions
(critical path, stage sum, overlap, pairwise overlaps, tool time, and per model ``p``,
``p_agg``, ``busy_mean``): thousands of requests per workflow at the cap, where the sampling
error is far below what traffic itself varies by, and grouping or sorting every call would
cost seconds.

Invariants:
- a retried call is one logical call: rows sharing a ``call_id`` collapse to the highest
  ``attempt``;
- calls without a request id are counted (``unidentified_calls``) and excluded from every
  per-request figure;
- an open row (a call in flight when the proxy flushed, ``shared.records``) that no finished
  row supersedes is a call still running: its start counts for its request's arrival, and its
  request is not completed (under overload this is what keeps the arrival rate and the
  completed requests honest); it feeds nothing else;
- a request arrives at its first call's start and counts only if that start lies in the window;
  it is *completed* when none of its calls still runs, its last call ended by
  ``t_to - settle`` and none of them failed on the serving side (5xx, 408, 429, 499: a
  failed request is an arrival, not a served request); only completed requests feed
  per-request figures;
- times in the output are seconds; nothing here opens files or runs SQL (:mod:`optimizer.stats.reader` does);
- a null ``model`` is reported under the name ``""``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np
import numpy.typing as npt

from optimizer.stats.modality import Split, bimodal_split
from optimizer.stats.scanned import Histogram, Scan
from optimizer.stats.union import (
    Segments,
    joint_union,
    mean_of,
    quantile_cont,
    request_starts,
    request_unions,
    segments,
)

US = 1_000_000.0
F64 = npt.NDArray[np.float64]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Window:
    """The time window to summarise; ``None`` bounds mean "as far as the data goes"."""

    t_from_us: int | None = None
    t_to_us: int | None = None
    settle_us: int = 0  # a request whose last call ended later than t_to - settle may still run


@dataclass(frozen=True, slots=True)
class TokenStats:
    """A token-count distribution over calls; ``nan`` where the engine reported no usage."""

    mean: float
    p50: float
    p90: float


@dataclass(frozen=True, slots=True)
class ModelStats:
    """One LLM's role in one workflow (an Aggregate LLM Pipeline stage's inputs)."""

    model: str
    calls: int  # calls of completed requests
    requests_calling: int  # completed requests calling it (scaled up from the sample)
    n: float  # mean calls per request, over all completed requests (paper n_m)
    p: float  # per request Σ durations / union length, averaged (paper p_m)
    p_agg: float  # Σ durations / Σ union lengths over requests: what makes n·L/p exact on average
    latency_mean: float  # mean call duration (s)
    busy_mean: float  # mean per-request union length of this model's calls (s)
    share_mean: float  # mean share of the request's summed LLM time
    share_cv: float  # coefficient of variation of that share across requests
    prompt_tokens: TokenStats
    completion_tokens: TokenStats


@dataclass(frozen=True, slots=True)
class Bimodality:
    """Requests fall into two populations by ``model``'s share of their LLM time."""

    model: str
    split: Split


@dataclass(frozen=True, slots=True)
class WorkflowStats:
    """One workflow over one window."""

    workflow: str
    requests: int  # completed requests
    arrivals: int  # requests whose first call started in the window
    arrival_rate: float  # arrivals per second (λ_w)
    window_s: float
    unidentified_calls: int  # calls in the window without a request id (excluded)
    latency_mean: float  # mean request span, first call start to last call end (s)
    latency_cv: float  # coefficient of variation of that span across requests
    critical_path_mean: float  # mean length of the union of all calls' intervals (s)
    stage_sum_mean: float  # mean Σ over models of the per-model union lengths (s)
    overlap_factor: float  # critical_path_mean / stage_sum_mean, in (0, 1]
    tool_time_mean: float  # mean time inside the span not covered by any call (s)
    models: Mapping[str, ModelStats]
    bimodal: Bimodality | None
    # Completed requests the per-request figures (shares, bimodality; critical path, stage
    # sum, overlap, tool time; per model p, p_agg, busy_mean) were computed over: all of them
    # unless the window held more than the workflow's share of the cap's calls, then a
    # uniform hash sample.
    union_requests: int = 0
    # Per pair of models (names sorted) whose calls run at once in a request: the mean
    # per-request time both run (the intersection of their unions, s); pairs that never
    # overlap are absent. Σ of the per-model unions less these is the critical path when
    # no three models run at once.
    overlaps: Mapping[tuple[str, str], float] = field(default_factory=dict)
    # Of tool_time_mean, the uncovered time right after calls that ran at once (module docstring)
    tool_time_after_fanout_mean: float = 0.0
    # Arrivals per second over the window's later half (nan: the window is unbounded): a rate
    # that is rising shows here a half window before it fills the whole window.
    arrival_rate_late: float = math.nan


def _cv(mean: float, mean_sq: float) -> float:
    if mean <= 0:
        return 0.0
    return math.sqrt(max(mean_sq - mean * mean, 0.0)) / mean


def _sample_unions(got: Scan) -> tuple[I64, Segments]:
    """The union of each sampled request's calls, and their per-pair segments with unions
    (``request`` indexes the sample)."""
    offsets = got.smp_off
    a, b = got.call_a, got.call_b
    starts = request_starts(a, offsets)
    scratch = np.empty_like(b)
    u_all = request_unions(a, b, starts, scratch)
    wf_of_pair = np.asarray([w for w, _ in got.pairs], dtype=np.int64)
    smp_wf = wf_of_pair[got.smp_pair] if got.smp_pair.size else np.zeros(0, np.int64)
    of_wf = [np.flatnonzero(smp_wf == w) for w in range(len(got.workflows))]
    seg = segments(got.call_pair, a, b, offsets, [of_wf[w] for w, _ in got.pairs], scratch)
    return u_all, seg


def assemble(got: Scan, window: Window, hi: int | None) -> dict[str, WorkflowStats]:
    n_wf = len(got.workflows)
    wf_of_pair = np.asarray([w for w, _ in got.pairs], dtype=np.int64)
    req_wf = wf_of_pair[got.req_pair] if got.req_pair.size else np.zeros(0, np.int64)
    smp_wf = wf_of_pair[got.smp_pair] if got.smp_pair.size else np.zeros(0, np.int64)
    u_all, useg = _sample_unions(got)
    n_req = np.bincount(req_wf, minlength=n_wf)
    n_smp = np.bincount(smp_wf, minlength=n_wf)
    span = (got.req_t1 - got.req_t0).astype(np.float64)
    u_sum = np.bincount(useg.request, weights=useg.union, minlength=got.smp_pair.size)

    def per_wf(x: npt.ArrayLike, keys: I64) -> F64:
        return np.bincount(keys, weights=x, minlength=n_wf).astype(np.float64)

    sum_span, sum_span_sq = per_wf(span, req_wf), per_wf(span * span, req_wf)
    sum_u_all, sum_u_sum = per_wf(u_all.astype(np.float64), smp_wf), per_wf(u_sum, smp_wf)
    sum_tool = per_wf(got.smp_span - u_all, smp_wf)
    after_fanout = _gaps_after_fanouts(
        got.call_a, got.call_b, request_starts(got.call_a, got.smp_off)
    )
    sum_after_fanout = per_wf(after_fanout, smp_wf)
    shares = _shares(got, useg)
    # Σ over the sample of each (workflow, model) pair's per-request union (µs)
    pair_union = np.bincount(useg.pair, weights=useg.union, minlength=len(got.pairs)).astype(
        np.float64
    )
    models = _models(got, useg, shares, pair_union, n_req, n_smp)
    bimodal = _bimodality(got, useg, shares, n_smp)
    overlaps = _overlaps(got, pair_union, sum_u_all < sum_u_sum, n_smp)
    out: dict[str, WorkflowStats] = {}
    lo = window.t_from_us
    for w, wf in enumerate(got.workflows):
        n, n_s = int(n_req[w]), int(n_smp[w])
        n_arr = int(got.arrivals[w])
        late = _late_rate(int(got.arrivals_late[w]), lo, hi)
        if n == 0:
            if got.unidentified[w] or n_arr:
                out[wf] = _none_completed(wf, n_arr, int(got.unidentified[w]), lo, hi, late)
            continue
        if lo is None or hi is None:  # the rate is (arrivals - 1) over first-to-last arrival
            t0 = got.req_t0[req_wf == w]
            rate_den, rate_num = float(t0.max() - t0.min()), n_arr - 1
        else:
            rate_den, rate_num = float(hi - lo), n_arr
        span_mean = sum_span[w] / n
        u_all_mean, u_sum_mean = sum_u_all[w] / n_s, sum_u_sum[w] / n_s
        out[wf] = WorkflowStats(
            workflow=wf,
            requests=n,
            arrivals=n_arr,
            arrival_rate=rate_num / (rate_den / US) if rate_den > 0 else 0.0,
            window_s=rate_den / US,
            unidentified_calls=int(got.unidentified[w]),
            latency_mean=float(span_mean) / US,
            latency_cv=_cv(float(span_mean), float(sum_span_sq[w] / n)),
            critical_path_mean=float(u_all_mean) / US,
            stage_sum_mean=float(u_sum_mean) / US,
            overlap_factor=float(u_all_mean / u_sum_mean) if u_sum_mean else 1.0,
            tool_time_mean=float(sum_tool[w] / n_s) / US,
            models=dict(sorted(models.get(w, {}).items())),
            bimodal=bimodal.get(w),
            union_requests=n_s,
            overlaps=overlaps.get(w, {}),
            tool_time_after_fanout_mean=float(sum_after_fanout[w] / n_s) / US,
            arrival_rate_late=late,
        )
    return dict(sorted(out.items()))


def _late_rate(arrivals_late: int, lo: int | None, hi: int | None) -> float:
    """Arrivals per second over ``[(lo + hi) // 2, hi)`` (nan without both bounds)."""
    if lo is None or hi is None or hi <= lo:
        return math.nan
    return arrivals_late / ((hi - (lo + hi) // 2) / US)


def _none_completed(
    wf: str, arrivals: int, unidentified: int, lo: int | None, hi: int | None, late: float
) -> WorkflowStats:
    """A workflow with calls but no completed request: every call lacked a request id (still
    show its count), or every request that arrived is still running (an overloaded workflow
    whose requests outlast the window: its arrivals are the one honest figure)."""
    span_us = float(hi - lo) if lo is not None and hi is not None else 0.0
    return WorkflowStats(
        workflow=wf,
        requests=0,
        arrivals=arrivals,
        arrival_rate=arrivals / (span_us / US) if span_us > 0 else 0.0,
        window_s=span_us / US,
        unidentified_calls=unidentified,
        latency_mean=math.nan,
        latency_cv=math.nan,
        critical_path_mean=math.nan,
        stage_sum_mean=math.nan,
        overlap_factor=1.0,
        tool_time_mean=math.nan,
        models={},
        bimodal=None,
        union_requests=0,
        tool_time_after_fanout_mean=math.nan,
        arrival_rate_late=late,
    )


def _gaps_after_fanouts(a: I64, b: I64, starts: I64) -> I64:
    """Per request (``starts``: its first call in the shifted layout), the summed gaps right
    after a block of two or more overlapping calls: a block is a run of calls each starting
    before the running maximum of the ends before it (calls that merely touch stay apart)."""
    out = np.zeros(starts.size, np.int64)
    if a.size == 0:
        return out
    reach = np.maximum.accumulate(b)  # never carries across requests (the layout's ranges)
    first = np.zeros(a.size, dtype=np.bool_)
    first[starts] = True
    opens = first.copy()
    opens[1:] |= a[1:] >= reach[:-1]
    block = np.cumsum(opens) - 1
    size = np.bincount(block)
    heads = np.flatnonzero(opens)
    follows = heads[~first[heads]]  # blocks after a gap inside their request
    after = size[block[follows] - 1] >= 2
    gap = a[follows] - reach[follows - 1]
    request = np.searchsorted(starts, follows, side="right") - 1
    np.add.at(out, request[after], gap[after])
    return out


def _overlaps(
    got: Scan, union: F64, overlapping: npt.NDArray[np.bool_], n_smp: npt.NDArray[np.int64]
) -> dict[int, dict[tuple[str, str], float]]:
    """Per workflow whose calls to different models ever run at once (``overlapping``), the
    mean per-request time each pair of its models runs together, over the sample: the two
    models' unions less their joint union. One pass over the sampled calls per model pair,
    and none for the workflows (most) whose models strictly alternate. ``union``: per pair,
    its summed per-request unions over the sample."""
    by_wf: dict[int, list[int]] = {}
    for pair, (w, _) in enumerate(got.pairs):
        if overlapping[w] and union[pair] > 0:
            by_wf.setdefault(w, []).append(pair)
    scratch = np.empty_like(got.call_b) if by_wf else None
    out: dict[int, dict[tuple[str, str], float]] = {}
    for w, pairs in by_wf.items():
        for i, j in combinations(pairs, 2):
            joint = joint_union(got.call_pair, got.call_a, got.call_b, (i, j), scratch)
            both = float(union[i] + union[j]) - joint
            if both > 0:
                names = sorted((got.pairs[i][1], got.pairs[j][1]))
                out.setdefault(w, {})[(names[0], names[1])] = both / int(n_smp[w]) / US
    return {w: dict(sorted(d.items())) for w, d in out.items()}


def _shares(got: Scan, useg: Segments) -> F64:
    """Each sampled segment's share of its request's summed LLM time (``nan`` where that
    is 0)."""
    total = got.smp_dur[useg.request].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(total != 0, useg.dur / total, np.nan)


def _models(
    got: Scan,
    useg: Segments,
    share: F64,
    s_union: F64,
    n_req: npt.NDArray[np.int64],
    n_smp: npt.NDArray[np.int64],
) -> dict[int, dict[str, ModelStats]]:
    """Per workflow and model: calls and durations over every completed request; the rest
    over the sample (``useg``; ``s_union``: per pair, its summed per-request unions)."""
    n_pairs = len(got.pairs)
    known = ~np.isnan(share)
    with np.errstate(divide="ignore", invalid="ignore"):
        p_seg = np.where(useg.union != 0, useg.dur / useg.union, np.nan)
    p_known = ~np.isnan(p_seg)

    def per_pair(x: npt.ArrayLike | None = None, mask: npt.NDArray[np.bool_] | None = None) -> F64:
        keys = useg.pair if mask is None else useg.pair[mask]
        weights = None if x is None else np.asarray(x)[mask] if mask is not None else x
        return np.bincount(keys, weights=weights, minlength=n_pairs).astype(np.float64)

    calling = per_pair()
    share_sum, share_sq = per_pair(share, known), per_pair(share * share, known)
    s_dur = per_pair(useg.dur)
    p_sum, p_n = per_pair(p_seg, p_known), per_pair(None, p_known)
    out: dict[int, dict[str, ModelStats]] = {}
    for pair in np.flatnonzero(got.pair_calls):
        w, model = got.pairs[pair]
        n, n_s = int(n_req[w]), int(n_smp[w])  # n_s >= 1: every workflow keeps a sample
        calls = int(got.pair_calls[pair])
        share_mean = float(share_sum[pair]) / n_s
        out.setdefault(w, {})[model] = ModelStats(
            model=model,
            calls=calls,
            # a model too rare to be in the sample still has a request calling it
            requests_calling=max(round(float(calling[pair]) * n / n_s), 1),
            n=calls / n,
            p=float(p_sum[pair] / p_n[pair]) if p_n[pair] else math.nan,
            p_agg=float(s_dur[pair] / s_union[pair]) if s_union[pair] else math.nan,
            latency_mean=float(got.pair_dur[pair]) / calls / US,
            busy_mean=float(s_union[pair]) / n_s / US,
            share_mean=share_mean,
            share_cv=_cv(share_mean, float(share_sq[pair]) / n_s),
            prompt_tokens=_tokens(got.prompt, int(pair)),
            completion_tokens=_tokens(got.completion, int(pair)),
        )
    return out


def _tokens(hist: Histogram, pair: int) -> TokenStats:
    lo, hi = np.searchsorted(hist.pair, [pair, pair + 1])
    values, counts = hist.value[lo:hi], hist.count[lo:hi]
    return TokenStats(
        mean=mean_of(values, counts),
        p50=quantile_cont(values, counts, 0.5),
        p90=quantile_cont(values, counts, 0.9),
    )


def _bimodality(
    got: Scan, useg: Segments, share: F64, n_smp: npt.NDArray[np.int64]
) -> dict[int, Bimodality]:
    """Per workflow, the model whose per-request share (over the sample) splits most cleanly
    in two, if any."""
    wf_of_pair = np.asarray([w for w, _ in got.pairs], dtype=np.int64)
    present = np.unique(useg.pair)
    models_in = np.bincount(wf_of_pair[present], minlength=len(got.workflows))
    best: dict[int, Bimodality] = {}
    bounds = np.asarray(np.searchsorted(useg.pair, np.r_[present, len(got.pairs)]), np.int64)
    for i, pair in enumerate(present):
        w, model = got.pairs[int(pair)]
        if models_in[w] < 2:
            continue
        values = np.zeros(int(n_smp[w]))  # requests that never call the model have share 0
        mine = share[bounds[i] : bounds[i + 1]]
        known = mine[~np.isnan(mine)]
        values[: known.size] = known
        split = bimodal_split(values)
        if split is not None and (w not in best or split.eta > best[w].split.eta):
            best[w] = Bimodality(model=model, split=split)
    return best
