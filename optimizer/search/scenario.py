"""Planning scenarios: workflows, target rates, a cluster and profiles in one YAML file.

Role: the input of ``scepsy allocate --scenario FILE`` when no trace store exists yet: each
workflow's Aggregate LLM Pipeline inputs (stages with ``n`` and ``p``, ``overlap``,
``tool_time``, the pairs of stages that run at once), its target rate, the ``cluster:``
section (as in the settings file), per model its memory floor and allowed TP degrees, and
profile points inline (a compact curve per model, TP degree and share) or from a profile JSON
file (``scepsy profile`` export format).

Invariants: decoded once with :func:`shared.settings_schema.decode` into frozen dataclasses; a
bad value raises :class:`SettingsError` naming its key path (``workflows[1].stages[0].p: ...``);
a relative ``profile_file`` is relative to the scenario file. :func:`problem` turns a scenario
into a :class:`optimizer.search.space.SearchProblem`; nothing else happens here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from optimizer.model.alp import Overlap, Pipeline, Stage
from optimizer.model.curves import ProfileBook
from optimizer.search.space import SearchProblem, WorkflowTarget
from shared.cluster import GB, ClusterSettings, cluster_from_settings
from shared.optimizer_settings import MAX_GRANULARITY
from shared.profile_points import ProfileError, ProfilePoint, import_json
from shared.settings_schema import SettingsError, decode, setting
from shared.yaml_file import read_yaml

__all__ = ["Scenario", "load_scenario", "problem"]


@dataclass(frozen=True)
class ScenarioStage:
    model: str = setting(doc="the LLM this stage calls")
    n: float = setting(doc="mean calls to it per workflow request")
    p: float = setting(1.0, doc="mean request-level parallelism of those calls (>= 1)")

    def __post_init__(self) -> None:
        if not self.n > 0:
            raise SettingsError("n", f"must be positive, got {self.n}")
        if not self.p >= 1:
            raise SettingsError("p", f"must be at least 1, got {self.p}")


@dataclass(frozen=True)
class ScenarioOverlap:
    a: str = setting(doc="a stage's model")
    b: str = setting(doc="another stage's model, whose calls run at the same time as a's")
    coupling: float = setting(
        1.0,
        doc=(
            "their mean time together over xy/(x+y) of their busy times x and y, in (0, 2]: 1 is "
            "two independent branches of exponential length (see optimizer.model.alp)"
        ),
    )

    def __post_init__(self) -> None:
        if self.a == self.b:
            raise SettingsError("b", f"must name another stage than a ({self.a!r})")
        if not 0 < self.coupling <= 2:
            raise SettingsError("coupling", f"must be in (0, 2], got {self.coupling}")


@dataclass(frozen=True)
class ScenarioWorkflow:
    name: str = setting(doc="workflow name")
    rate: float = setting(doc="target rate, workflow requests per second")
    stages: tuple[ScenarioStage, ...] = setting(doc="one stage per LLM the workflow calls")
    overlap: float = setting(1.0, doc="critical path / Σ per-model busy time, in (0, 1]")
    tool_time: float = setting(0.0, doc="seconds per request spent outside LLM calls")
    overlaps: tuple[ScenarioOverlap, ...] = setting(
        (),
        doc=(
            "pairs of stages whose calls run at once; given, they replace overlap in predictions, "
            "which then keeps ranking the search's budgets"
        ),
    )

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise SettingsError("rate", f"must be positive, got {self.rate}")
        if not self.stages:
            raise SettingsError("stages", "a workflow needs at least one stage")
        models = [s.model for s in self.stages]
        for i, m in enumerate(models):
            if m in models[:i]:
                raise SettingsError(f"stages[{i}].model", f"{m!r} has a stage already")
        if not 0 < self.overlap <= 1:
            raise SettingsError("overlap", f"must be in (0, 1], got {self.overlap}")
        if self.tool_time < 0:
            raise SettingsError("tool_time", "must not be negative")
        for i, o in enumerate(self.overlaps):
            for key in ("a", "b"):
                if getattr(o, key) not in models:
                    raise SettingsError(
                        f"overlaps[{i}].{key}",
                        f"{getattr(o, key)!r} is not one of the stages {models}",
                    )

    def pipeline(self) -> Pipeline:
        return Pipeline(
            self.name,
            tuple(Stage(s.model, s.n, s.p) for s in self.stages),
            self.overlap,
            self.tool_time,
            tuple(Overlap(o.a, o.b, o.coupling) for o in self.overlaps),
        )


@dataclass(frozen=True)
class ScenarioModel:
    name: str = setting(doc="model name")
    min_memory_gb: float = setting(0.0, doc="least memory a replica needs over all its GPUs")
    tp: tuple[int, ...] = setting(
        factory=tuple, doc="allowed TP degrees (default: every profiled degree)"
    )

    def __post_init__(self) -> None:
        if self.min_memory_gb < 0:
            raise SettingsError("min_memory_gb", "must not be negative")
        for i, t in enumerate(self.tp):
            if t < 1 or t & (t - 1):
                raise SettingsError(f"tp[{i}]", f"must be a power of two, got {t}")


@dataclass(frozen=True)
class CurvePoint:
    rate: float = setting(doc="offered rate, calls per second")
    latency: float = setting(doc="mean call latency (s) at that rate")
    throughput: float | None = setting(None, doc="achieved calls/s (default: rate, kept up)")
    p50: float | None = setting(None, doc="median latency (default: the mean)")
    p90: float | None = setting(None, doc="90th percentile latency (default: the mean)")
    p99: float | None = setting(None, doc="99th percentile latency (default: the mean)")
    ttft: float = setting(0.0, doc="mean time to first token (s)")

    def __post_init__(self) -> None:
        if self.rate < 0 or not self.latency > 0:
            raise SettingsError("latency", "rate >= 0 and latency > 0 required")


@dataclass(frozen=True)
class ScenarioProfile:
    model: str = setting(doc="profiled model")
    points: tuple[CurvePoint, ...] = setting(doc="the curve, light load to saturation")
    tp: int = setting(1, doc="TP degree of the profile")
    share: float = setting(1.0, doc="GPU share of the profile")
    engine: str = setting("scenario", doc="engine label")

    def __post_init__(self) -> None:
        if not self.points:
            raise SettingsError("points", "a profile needs at least one point")
        if self.tp < 1 or not 0 < self.share <= 1:
            raise SettingsError("tp", "tp >= 1 and 0 < share <= 1 required")


@dataclass(frozen=True)
class Scenario:
    """A whole scenario file."""

    workflows: tuple[ScenarioWorkflow, ...] = setting(doc="the workflows and their rates")
    cluster: ClusterSettings = setting(doc="the GPU cluster (as in the settings file)")
    models: tuple[ScenarioModel, ...] = setting(factory=tuple, doc="memory floors, TP degrees")
    profiles: tuple[ScenarioProfile, ...] = setting(factory=tuple, doc="inline profile curves")
    profile_file: str | None = setting(None, doc="profile JSON (scepsy profile export format)")
    description: str = setting("", doc="what the scenario is (say where numbers came from)")
    granularity: int = setting(
        10, doc=f"GPU units per GPU the search allocates in (1 to {MAX_GRANULARITY})"
    )
    headroom: float = setting(0.1, doc="throughput must cover rate x (1 + headroom)")
    welfare: Literal["egalitarian", "social"] = setting("egalitarian", doc="workflow split")
    stat: Literal["mean", "p50", "p90", "p99"] = setting("mean", doc="latency statistic")

    def __post_init__(self) -> None:
        names = [w.name for w in self.workflows]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise SettingsError(f"workflows[{i}].name", f"{name!r} is listed twice")
        if not self.workflows:
            raise SettingsError("workflows", "at least one workflow is needed")
        if not 1 <= self.granularity <= MAX_GRANULARITY:
            raise SettingsError(
                "granularity", f"must be between 1 and {MAX_GRANULARITY}, got {self.granularity}"
            )
        if self.headroom < 0:
            raise SettingsError("headroom", "must not be negative")


def _points(scenario: Scenario, gpu_type: str) -> list[ProfilePoint]:
    out = []
    for prof in scenario.profiles:
        for c in prof.points:
            out.append(
                ProfilePoint(
                    prof.model,
                    prof.engine,
                    gpu_type,
                    prof.tp,
                    prof.share,
                    c.rate,
                    c.rate if c.throughput is None else c.throughput,
                    c.latency,
                    c.latency if c.p50 is None else c.p50,
                    c.latency if c.p90 is None else c.p90,
                    c.latency if c.p99 is None else c.p99,
                    c.ttft,
                    0,
                )
            )
    return out


def load_scenario(path: str | Path) -> tuple[Scenario, list[ProfilePoint]]:
    """Read and validate a scenario file, and its profile points (inline and from the file)."""
    path = Path(path)
    data: Any = read_yaml(path, "scenario")
    scenario = decode(Scenario, data)
    cluster = cluster_from_settings(scenario.cluster)
    points = _points(scenario, cluster.gpu_types[0])
    if scenario.profile_file is not None:
        file = Path(scenario.profile_file)
        file = file if file.is_absolute() else path.parent / file
        try:
            points += import_json(file.read_bytes())
        except OSError as exc:
            raise SettingsError("profile_file", f"cannot read {file}: {exc.strerror}") from exc
        except ProfileError as exc:
            raise SettingsError("profile_file", str(exc)) from exc
    profiled = {p.model for p in points}
    for i, wf in enumerate(scenario.workflows):
        for j, st in enumerate(wf.stages):
            if st.model not in profiled:
                raise SettingsError(
                    f"workflows[{i}].stages[{j}].model",
                    f"no profile for {st.model!r} (profiled: "
                    f"{', '.join(sorted(profiled)) or 'none'})",
                )
    return scenario, points


def problem(scenario: Scenario, points: list[ProfilePoint]) -> SearchProblem:
    """The search problem a scenario describes."""
    return SearchProblem(
        workflows=tuple(WorkflowTarget(w.pipeline(), w.rate) for w in scenario.workflows),
        book=ProfileBook(points),
        cluster=cluster_from_settings(scenario.cluster),
        memory_floor_bytes={m.name: round(m.min_memory_gb * GB) for m in scenario.models},
        tp_degrees={m.name: m.tp for m in scenario.models if m.tp},
        granularity=scenario.granularity,
        headroom=scenario.headroom,
        welfare=scenario.welfare,
        stat=scenario.stat,
    )
