"""A profiling run's group and sweep, and its replica stopped whatever goes wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimizer.control.reprofile import ReprofileRequest, Slot, is_profiling
from optimizer.plan.target import GroupSpec
from optimizer.profiling import auto
from optimizer.profiling.window import QUICK, SweepSettings
from optimizer.rollout.backend import RolloutError
from shared.optimizer_settings import ReprofileSettings
from tests.optimizer.daemon.test_daemon import FakeBackend
from tests.optimizer.daemon.test_daemon_reprofile import (
    MODEL,
    TINY,
    ProfilingBackend,
    _settings,
    _trace,
    engine,  # noqa: F401  (the fixture)
)

REQ = ReprofileRequest(MODEL, "a6000", 1, 0.5, "uncovered", "")
SLOT = Slot("n0", (1,), "a6000")


def test_the_group_is_one_replica_marked_as_profiling(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    group = auto.profiling_group(REQ, SLOT, settings)
    assert group.id.startswith("profiling-") and (group.node, group.gpus) == ("n0", (1,))
    (replica,) = group.replicas
    assert (replica.spec.model, replica.spec.share, replica.spec.tp) == (MODEL, 0.5, 1)
    gpu = 48 * 1024**3
    assert 0.4 * gpu < replica.spec.memory_bytes_per_gpu <= 0.5 * gpu
    assert auto.profiling_group(REQ, SLOT, settings) == group  # the same run, the same id


def test_the_sweep_follows_the_settings() -> None:
    assert auto.sweep_settings(ReprofileSettings()) == QUICK
    full = auto.sweep_settings(ReprofileSettings(quick=False, calls_per_point=300))
    assert full.calls_per_point == 300 and full.max_points == SweepSettings().max_points


class FailingBackend(FakeBackend):
    async def wait_ready(self, group: GroupSpec) -> None:
        raise RolloutError("the engine crashed")


async def test_the_replica_is_stopped_when_the_run_fails(tmp_path: Path) -> None:
    _trace(tmp_path)
    backend = FailingBackend()
    with pytest.raises(RolloutError):
        await auto.reprofile(REQ, SLOT, backend, _settings(tmp_path))
    assert len(backend.stopped) == 1 and backend.stopped[0].startswith("profiling-")
    assert not any(is_profiling(r) for r in backend.replicas.values())


async def test_packed_copies_run_side_by_side_and_are_measured_per_copy(
    tmp_path: Path,
    engine: str,  # noqa: F811
) -> None:
    _trace(tmp_path)
    packed = ReprofileRequest(MODEL, "a6000", 1, 0.5, "uncovered", "", copies=2)
    group = auto.profiling_group(packed, SLOT, _settings(tmp_path))
    assert (
        len(group.replicas) == 2
        and group.id != auto.profiling_group(REQ, SLOT, _settings(tmp_path)).id
    )
    assert {r.spec.share for r in group.replicas} == {0.5}
    backend = ProfilingBackend(engine)
    out = await auto.reprofile(packed, SLOT, backend, _settings(tmp_path), sweep=TINY)
    started, _ = backend.at_start[0]
    assert started == group and backend.stopped == [group.id]
    assert out.points and {p.colocation for p in out.points} == {"packed"}
    assert {p.share for p in out.points} == {0.5}
    assert "x2 packed" in out.summary()
