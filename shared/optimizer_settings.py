"""The ``optimizer:`` settings section: how the daemon watches traffic and when it re-plans.

Role: the schema of the optimizer daemon's loop (DESIGN §3.8): how often it looks, over which
window, what counts as a change (rate threshold held for several windows, token drift, observed
latency straying from prediction), and when a new allocation is worth rolling out (relative
gain, gain over a horizon against the cost of the move, cooldown). The search's own knobs
(granularity, headroom, welfare policy) and the daemon's health/metrics address live here too.
Which backend rolls out is ``rollout.backend`` (one knob, not two).

Invariants: decoded once by :func:`shared.settings_schema.decode`, frozen afterwards; a bad value
raises :class:`SettingsError` naming its key path relative to ``optimizer``. Times are seconds;
thresholds are relative (0.3 = 30%).

A note on windows: a rate shift is confirmed after ``windows_to_confirm`` consecutive windows
past the threshold, and the re-plan uses the latest window's rate. When
``(windows_to_confirm - 1) * interval_s >= window_s`` that latest window lies wholly after the
shift, so one shift is planned for once, at its full size (the defaults satisfy this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.settings_schema import SettingsError, setting

__all__ = ["MAX_GRANULARITY", "OptimizerSettings", "ReprofileSettings"]

# The search's tables grow with GPUs x granularity (10,000,000 asked for 1.16 TiB); shares finer
# than 1% of a GPU are below what an engine's memory fraction can tell apart anyway.
MAX_GRANULARITY = 100


@dataclass(frozen=True)
class ReprofileSettings:
    """When the daemon profiles a model on its own (:mod:`optimizer.control.reprofile`)."""

    enabled: bool = setting(
        True,
        doc="profile on its own: a model in traffic without a profile, a (model, GPU, TP, "
        "share) a proposal wants that no point covers, a workflow whose latency strays from "
        "its prediction; only on GPUs no served model uses or needs",
    )
    min_interval_s: float = setting(
        3600.0, doc="least time between two profiling runs of one model (a failed one counts)"
    )
    drift_threshold: float = setting(
        0.5,
        doc="relative gap |predicted - observed| / observed of a workflow's latency that "
        "counts towards a drift reprofile",
    )
    drift_windows: int = setting(
        3, doc="consecutive passes the gap must hold, each with min_requests, before it fires"
    )
    min_requests: int = setting(
        20, doc="completed requests a window needs for its latency to count towards drift"
    )
    max_gpus: int = setting(1, doc="most GPUs one profiling replica may take (its TP degree)")
    borrowed_shares: bool = setting(
        True,
        doc="profile a share the proposal wants for a (model, GPU, TP) that has no fractional "
        "share measured at all: its share curve borrows other models' exponents (a "
        "prefill-bound verifier read a memory-bound generator's and was predicted 2.4x slow "
        "beside a busy neighbour, simulated)",
    )
    scaled_shares: bool = setting(
        False,
        doc="also profile a share the proposal wants that is only scaled from another "
        "profiled share of the same (model, GPU, TP)",
    )
    packed_shares: bool = setting(
        True,
        doc="profile a share the proposal packs two or more copies of onto one GPU, with as "
        "many copies as fill the GPU side by side, where no packed point of it was measured: "
        "alone points say nothing of what the copies cost each other (two packed half-GPU "
        "verifiers serve 0.89 of a whole GPU where the alone curves say 1.0, simulated)",
    )
    quick: bool = setting(True, doc="fewer, shorter sweep points (as `scepsy profile --quick`)")
    calls_per_point: int | None = setting(
        None, doc="calls replayed per sweep point (null: the sweep's default)"
    )

    def __post_init__(self) -> None:
        if self.min_interval_s < 0:
            raise SettingsError("min_interval_s", "must not be negative")
        if not self.drift_threshold > 0:
            raise SettingsError("drift_threshold", "must be positive (a relative gap, 0.5 = 50%)")
        for key in ("drift_windows", "min_requests", "max_gpus"):
            if getattr(self, key) < 1:
                raise SettingsError(key, "must be at least 1")
        if self.calls_per_point is not None and self.calls_per_point < 1:
            raise SettingsError("calls_per_point", "must be at least 1")


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer daemon (``scepsy run``)."""

    interval_s: float = setting(60.0, doc="seconds between two passes of the loop")
    window_s: float = setting(
        120.0, doc="statistics window: each pass summarises the calls of the last window_s"
    )
    settle_s: float = setting(
        5.0,
        doc="requests whose last call ended within settle_s of the window's end may still be "
        "running: they count as arrivals but not (yet) as completed",
    )
    min_requests: int = setting(
        20, doc="completed requests a workflow needs in a window before its figures are trusted"
    )
    rate_change_threshold: float = setting(
        0.3, doc="relative change of a workflow's arrival rate that counts as a shift"
    )
    windows_to_confirm: int = setting(
        3, doc="consecutive windows a change must persist before the daemon acts on it"
    )
    overload_windows_to_confirm: int = setting(
        2,
        doc="consecutive windows in which what runs is predicted past its capacity at the "
        "observed rate before the daemon acts (at most windows_to_confirm: an overload's "
        "backlog grows while it waits, as an autoscaler scales up at once); one window when "
        "the live window shows it too (requests slower by latency_drift_threshold, or too "
        "few completing)",
    )
    token_drift_threshold: float = setting(
        0.5, doc="relative change of a model's mean prompt or completion tokens that counts"
    )
    latency_drift_threshold: float = setting(
        0.5,
        doc="relative gap between observed and predicted workflow latency that counts "
        "(checked only on windows that start after the last rollout ended)",
    )
    cooldown_s: float = setting(
        300.0, doc="least time between the end of one rollout and the start of the next"
    )
    min_gain: float = setting(
        0.1, doc="least relative latency gain (rate-weighted over workflows) worth a rollout"
    )
    horizon_s: float = setting(
        1800.0,
        doc="the gain is counted over this long (request-seconds saved) and must outweigh "
        "the move's cost",
    )
    cold_start_s: float = setting(
        90.0,
        doc="engine start cost of a moved replica (calibration.md: 52-110 s for an 8B model "
        "on vLLM; the emulator starts in about a second)",
    )
    reprofile_min_interval_s: float = setting(
        3600.0,
        doc="read by nothing, kept so older settings files still load: the daemon's "
        "profiling runs follow reprofile.min_interval_s",
    )
    granularity: int = setting(
        10,
        doc=f"GPU-share units per GPU the search considers (1 to {MAX_GRANULARITY}); the "
        "search's time grows about with its cube (8 GPUs: 10 takes about a second, 100 about "
        "40 s and 4.5 GB)",
    )
    reserve_gpus: int = setting(
        0,
        doc="whole GPUs the search leaves free (the highest-numbered of the last node), so "
        "that a rollout can start temporary copies there and never leave a model unserved "
        "while its replicas move; 0 on a cluster with room to spare",
    )
    headroom: float = setting(
        0.1, doc="the chosen throughput must cover the arrival rate x (1 + headroom)"
    )
    welfare: Literal["egalitarian", "social"] = setting(
        "egalitarian",
        doc="how GPUs are split between workflows: egalitarian (max-min utility, the paper's) "
        "or social (sum of utilities)",
    )
    listen: str = setting(
        "127.0.0.1:9400", doc="HOST:PORT of the daemon's /health and /metrics (port 0: any)"
    )
    apply: bool = setting(
        True, doc="roll decisions out (false: decide, record and export metrics only)"
    )
    health_failed_passes: int = setting(
        3,
        doc="consecutive failed passes (an exception: store or backend unreadable) after which "
        "/health/ready and /health answer 503 with the last error; they do too when no pass "
        "has succeeded for 3 x interval_s + 60 s",
    )
    reprofile: ReprofileSettings = setting(
        factory=ReprofileSettings, doc="profiling runs the daemon starts on its own"
    )

    def __post_init__(self) -> None:
        for key in ("interval_s", "window_s", "horizon_s"):
            if getattr(self, key) <= 0:
                raise SettingsError(key, "must be positive")
        for key in (
            "settle_s",
            "cooldown_s",
            "cold_start_s",
            "reprofile_min_interval_s",
            "headroom",
            "min_gain",
        ):
            if getattr(self, key) < 0:
                raise SettingsError(key, "must not be negative")
        for key in ("rate_change_threshold", "token_drift_threshold", "latency_drift_threshold"):
            if not getattr(self, key) > 0:
                raise SettingsError(key, "must be positive (a relative change, 0.3 = 30%)")
        if self.settle_s >= self.window_s:
            raise SettingsError("settle_s", "must be shorter than window_s")
        if self.granularity > MAX_GRANULARITY:
            raise SettingsError(
                "granularity", f"must be at most {MAX_GRANULARITY}, got {self.granularity}"
            )
        if self.reserve_gpus < 0:
            raise SettingsError("reserve_gpus", "must not be negative")
        for key in (
            "windows_to_confirm",
            "overload_windows_to_confirm",
            "granularity",
            "min_requests",
            "health_failed_passes",
        ):
            if getattr(self, key) < 1:
                raise SettingsError(key, "must be at least 1")
        # Imported here: shared.settings imports this module to build the root settings.
        from shared.settings import parse_host_port

        parse_host_port(self.listen, "listen")
