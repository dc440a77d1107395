"""The emulator's real-time driver: runs the clock-free EngineCore on the wall clock.

Role: one asyncio task per emulated engine repeatedly asks the core for a step, sleeps the
step's modelled duration divided by the speed-up, then hands each request its progress (first
token, tokens emitted, finished) through the queue its HTTP handler listens on.

Invariants:
- the model's clock is the wall clock times ``speedup``; step k of a busy period ends at
  ``anchor + sum(durations[:k+1]) / speedup`` (sleeps are scheduled against that target, so
  timer overshoot in one step is recovered in the next instead of accumulating);
- when the driver falls more than ``max_catch_up_s`` behind (Python work per step exceeding the
  step's wall budget, or the OS waking it late), it re-anchors instead of bursting; the time
  lost (step wall time minus the wall time the model asked for) is reported two ways, both
  exponentially averaged over ~``lag_window_s`` seconds: ``lag_ratio``, lost time over all
  wall time (how far the model's clock drifts behind wall x speed-up), and ``step_stretch``,
  lost time over the intended busy time (how much slower a busy engine runs than modelled);
- a request's updates arrive in order and end with exactly one ``finished`` update, unless it
  is aborted first (then nothing more arrives); a request submitted with ``every_token=False``
  (a non-streaming call) gets only its first-token and finished updates.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from sim.engine import EngineCore, EngineRequest, StepOutcome

# asyncio's selector waits whole milliseconds, rounding up (epoll), so a 0.2 ms sleep lasts
# 1 ms. Aiming half a millisecond early centres the wake-up error on zero; delays shorter
# than that are not slept at all (the next steps of a busy period make up the difference).
SLEEP_ROUNDING_S = 0.0005


class Update(NamedTuple):
    """Progress of one choice, as of the end of one engine step."""

    choice: int  # the request's index within its HTTP call (choice, input or pair)
    emitted: int  # tokens emitted so far (cumulative, never above the planned count)
    first: bool  # prefill finished in this step (first token or pooled result ready)
    finished: bool


@dataclass
class Ticket:
    """The driver's record of one engine request; times are wall-clock seconds."""

    rid: str
    index: int
    output_tokens: int
    sink: asyncio.Queue[Update]
    arrival: float
    first_at: float | None = None
    finished_at: float | None = None
    emitted: int = 0
    prompt_tokens: int = 0
    request: EngineRequest | None = None
    every_token: bool = True  # False: only the first-token and finished updates are sent
    on_cached: Callable[[int], None] | None = None  # told the prompt tokens found in cache


@dataclass
class _LagMeter:
    """Exponentially weighted lost time (see module invariants), over all wall time (clock
    lag) and over busy wall time only (step stretch)."""

    window_s: float
    last: float
    elapsed: float = 0.0  # decayed wall time, busy and idle
    busy: float = 0.0  # decayed wall time spent in steps
    lost: float = 0.0  # decayed (step wall - intended step wall); negative when catching up
    lost_total: float = 0.0
    busy_total: float = 0.0

    def add_step(self, end: float, wall: float, intended: float) -> None:
        dt = max(0.0, end - self.last)
        keep = math.exp(-dt / self.window_s)
        self.elapsed = self.elapsed * keep + dt
        self.busy = self.busy * keep + wall
        self.lost = self.lost * keep + (wall - intended)
        self.last = end
        self.lost_total += wall - intended
        self.busy_total += wall

    def clock_lag(self, now: float) -> float:
        """Fraction of recent wall time by which the model's clock fell behind."""
        dt = max(0.0, now - self.last)
        keep = math.exp(-dt / self.window_s)
        elapsed = self.elapsed * keep + dt
        return self.lost * keep / elapsed if elapsed > 0 else 0.0

    @property
    def step_stretch(self) -> float:
        """Recent busy wall time over the wall time the steps asked for, minus 1."""
        intended = self.busy - self.lost
        return self.lost / intended if intended > 0 else 0.0


@dataclass
class EngineDriver:
    """Paces an EngineCore in real time (``speedup`` model seconds per wall second)."""

    core: EngineCore
    speedup: float = 1.0
    max_catch_up_s: float = 0.05
    lag_window_s: float = 10.0
    on_finished: Callable[[Ticket], None] | None = None
    # co-located engines (sim.colocation): called before each step of a busy period, and
    # once when it ends
    before_step: Callable[[], None] | None = None
    on_idle: Callable[[], None] | None = None
    clock: Callable[[], float] = time.monotonic
    tickets: dict[str, Ticket] = field(default_factory=dict)
    steps_total: int = 0
    model_busy_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"speedup must be positive, got {self.speedup}")
        self._wake = asyncio.Event()
        self._t0 = self.clock()
        self._lag = _LagMeter(self.lag_window_s, self._t0)

    # -- requests ------------------------------------------------------------------------
    def submit(
        self,
        rid: str,
        prompt: Sequence[int],
        output_tokens: int,
        sink: asyncio.Queue[Update],
        index: int = 0,
        *,
        every_token: bool = True,
    ) -> Ticket:
        now = self.clock()
        req = EngineRequest(rid, prompt, output_tokens, arrival=self.model_now())
        ticket = Ticket(
            rid,
            index,
            output_tokens,
            sink,
            now,
            prompt_tokens=len(prompt),
            request=req,
            every_token=every_token,
        )
        self.core.submit(req)  # first: a refused request (ValueError) leaves no ticket behind
        self.tickets[rid] = ticket
        self._wake.set()
        return ticket

    def abort(self, rid: str) -> None:
        if self.tickets.pop(rid, None) is not None:
            self.core.abort(rid)

    # -- clocks --------------------------------------------------------------------------
    def model_now(self) -> float:
        """Model seconds since the driver started (wall time x speed-up)."""
        return (self.clock() - self._t0) * self.speedup

    def model_seconds(self, wall_s: float) -> float:
        return wall_s * self.speedup

    @property
    def lag_ratio(self) -> float:
        """How far the model's clock fell behind wall x speed-up, as a fraction of recent
        wall time (idle time included: an idle engine keeps its clock)."""
        return self._lag.clock_lag(self.clock())

    @property
    def step_stretch(self) -> float:
        """Recent busy steps' wall time over what the model asked for, minus 1."""
        return self._lag.step_stretch

    @property
    def busy_wall_s(self) -> float:
        return self._lag.busy_total

    @property
    def lost_wall_s(self) -> float:
        return self._lag.lost_total

    # -- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        """Step the core forever; cancel the task to stop."""
        while True:
            if not self.core.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._busy_period()

    async def _busy_period(self) -> None:
        try:
            await self._steps()
        finally:
            if self.on_idle is not None:
                self.on_idle()

    async def _steps(self) -> None:
        target = prev_end = self.clock()
        while self.core.has_work():
            if self.before_step is not None:
                self.before_step()
            outcome = self.core.step()
            if outcome.duration <= 0 and not (outcome.emitted or outcome.finished):
                await asyncio.sleep(0.001)  # nothing schedulable yet: do not spin
                continue
            self.steps_total += 1
            self.model_busy_s += outcome.duration
            intended = outcome.duration / self.speedup
            target += intended
            delay = target - self.clock()
            if delay > SLEEP_ROUNDING_S:
                await asyncio.sleep(delay - SLEEP_ROUNDING_S)
            else:
                if -delay > self.max_catch_up_s:
                    target = self.clock()  # too far behind: give the time up, counted as lag
                await asyncio.sleep(0)  # let handlers run even when behind
            end = self.clock()
            self._lag.add_step(end, end - prev_end, intended)
            prev_end = end
            self._deliver(outcome, end)

    def _deliver(self, outcome: StepOutcome, now: float) -> None:
        first = set(outcome.first_token)
        finished = set(outcome.finished)
        touched: dict[str, None] = dict.fromkeys(outcome.first_token)
        for rid, count in outcome.emitted:
            ticket = self.tickets.get(rid)
            if ticket is not None:
                ticket.emitted = min(ticket.output_tokens, ticket.emitted + count)
                touched[rid] = None
        touched.update(dict.fromkeys(outcome.finished))
        for rid in touched:
            ticket = self.tickets.get(rid)
            if ticket is None:
                continue
            done = rid in finished
            # A token or a completion implies the prefill is over, whatever the core listed.
            is_first = ticket.first_at is None and (rid in first or ticket.emitted > 0 or done)
            if is_first:
                ticket.first_at = now
                if ticket.on_cached is not None:
                    ticket.on_cached(outcome.cached_tokens.get(rid, 0))
            if done:
                ticket.emitted = ticket.output_tokens
                ticket.finished_at = now
                del self.tickets[rid]
            if is_first or done or ticket.every_token:  # waking a handler per token costs
                ticket.sink.put_nowait(Update(ticket.index, ticket.emitted, is_first, done))
            if done and self.on_finished is not None:
                self.on_finished(ticket)
