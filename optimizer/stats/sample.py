"""The union sample's policy: which completed requests the per-(request, model) figures see.

Role: pure arithmetic over per-workflow counts, no SQL; :mod:`optimizer.stats.scan` applies
it as a hash threshold on each request key (``key % SAMPLE_MODULUS < threshold``).

Invariants (DESIGN §3.4):
- the sample is a pure function of each workflow's numbers of calls and requests (with the
  request keys, the same store gives the same sample);
- it holds every request when all of them hold at most ``union_cap`` calls;
- the cap is shared out smallest workflow first, and no workflow's budget is under a tenth
  of it (a quiet workflow beside a busy one keeps a sample of its own);
- a sampled workflow keeps at least about ``min(SAMPLE_MIN_REQUESTS, budget /
  SAMPLE_MIN_REQUESTS_PER)`` requests however long they are, and never none
  (:func:`keep_thresholds` lets each workflow's lowest key in).
"""

from __future__ import annotations

from collections.abc import Sequence

# The union sample: about this many calls at most (10 M calls sort in seconds, 1 M in a tenth
# of that; a mean over the tens of thousands of requests they hold is as good as exact).
UNION_CALLS_CAP = 1_000_000
SAMPLE_MODULUS = 1 << 20  # a request is sampled when its key modulo this is below a threshold
# A workflow's sample holds at least about min(SAMPLE_MIN_REQUESTS, budget /
# SAMPLE_MIN_REQUESTS_PER) requests however long they are, and never none.
SAMPLE_MIN_REQUESTS = 2_000
SAMPLE_MIN_REQUESTS_PER = 50


def workflow_budgets(union_cap: int | None, calls: Sequence[int]) -> list[int | None]:
    """The calls each workflow's sample may hold (``None``: all of them). Everything fits
    under the cap: no sampling. Otherwise the cap is shared out, smallest workflows first, a
    workflow that needs less than its share passing the rest on; no budget is under a tenth
    of the cap (a quiet workflow beside busy ones still gets a sample that size, so with more
    than ten busy workflows the sample holds more than the cap)."""
    if union_cap is None or sum(calls) <= union_cap:
        return [None] * len(calls)
    out: list[int | None] = [None] * len(calls)
    left, waiting = union_cap, sum(1 for c in calls if c)
    for w in sorted(range(len(calls)), key=lambda w: calls[w]):
        if not calls[w]:
            continue
        share = max(left // waiting, union_cap // 10)
        out[w] = None if calls[w] <= share else share
        left, waiting = max(left - min(calls[w], share), 0), waiting - 1
    return out


def sample_threshold(calls: int, requests: int, budget: int | None) -> int:
    """A workflow's requests whose key modulo ``SAMPLE_MODULUS`` lies below this are in the
    sample: all of them when its ``calls`` fit in ``budget`` (or there is no budget), else
    about ``budget`` calls' worth, but never fewer than about ``min(SAMPLE_MIN_REQUESTS,
    budget / SAMPLE_MIN_REQUESTS_PER)`` requests (long requests must not leave the sample
    nearly empty)."""
    if budget is None or calls <= budget:
        return SAMPLE_MODULUS
    floor = min(SAMPLE_MIN_REQUESTS, max(1, budget // SAMPLE_MIN_REQUESTS_PER))
    if requests <= floor:
        return SAMPLE_MODULUS
    return min(
        SAMPLE_MODULUS,
        max(budget * SAMPLE_MODULUS // calls, -(-floor * SAMPLE_MODULUS // requests)),
    )


def keep_thresholds(
    union_cap: int | None, calls: Sequence[int], requests: Sequence[int], lowest: Sequence[int]
) -> list[int]:
    """Per workflow, the threshold its request keys (modulo ``SAMPLE_MODULUS``) must lie
    below: :func:`sample_threshold` under :func:`workflow_budgets`, raised so that the
    workflow's ``lowest`` key is let in (a workflow's sample is never empty)."""
    budgets = workflow_budgets(union_cap, [int(c) for c in calls])
    return [
        max(
            sample_threshold(int(calls[w]), int(requests[w]), budgets[w]),
            min(lowest[w] + 1, SAMPLE_MODULUS),
        )
        for w in range(len(calls))
    ]
