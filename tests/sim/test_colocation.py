"""Emulated engines on one GPU see each other's work through the GPU board and contend."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from sim.colocation import SLOTS, STALE_S, GpuBoard, Neighbours, attach
from sim.engine import EngineCore
from sim.perf import contention, perf_model

SLOT_BYTES = 32  # pid, token, share, busy_at


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.timeout(30)
def test_a_busy_neighbour_is_seen_an_idle_or_stale_one_is_not(tmp_path: Path) -> None:
    clock = Clock()
    a = Neighbours(tmp_path, [0], 0.5, clock)
    b = Neighbours(tmp_path, [0], 0.25, clock)
    other_gpu = Neighbours(tmp_path, [1], 0.5, clock)
    assert b.busy_shares() == ()  # a has not worked yet
    assert a.busy_shares() == (0.25,)  # b's call above marked it busy
    assert b.busy_shares() == (0.5,)
    assert other_gpu.busy_shares() == ()
    a.idle()
    assert b.busy_shares() == ()
    a.busy_shares()
    clock.t += STALE_S + 0.1  # a stopped stepping without going idle (it died busy)
    assert b.busy_shares() == ()
    for n in (a, b, other_gpu):
        n.close()


@pytest.mark.timeout(30)
def test_a_tensor_parallel_neighbour_counts_once(tmp_path: Path) -> None:
    tp2 = Neighbours(tmp_path, [0, 1], 0.5)
    me = Neighbours(tmp_path, [0, 1], 0.5)
    tp2.busy_shares()
    assert me.busy_shares() == (0.5,)
    tp2.close()
    me.close()


@pytest.mark.timeout(30)
def test_a_dead_engines_slot_is_reused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(done.stdout)
    path = tmp_path / "gpu-0"
    boards = [GpuBoard(path, 0.1, token=k) for k in range(SLOTS)]
    with pytest.raises(ValueError, match="slots"):
        GpuBoard(path, 0.1, token=99)
    with path.open("r+b") as f:  # the engine in slot 3 died: its slot names a gone process
        f.seek(3 * SLOT_BYTES)
        f.write(struct.pack("<q", dead))
    assert GpuBoard(path, 0.1, token=100).slot == 3
    assert len(boards) == SLOTS


@pytest.mark.timeout(30)
def test_an_engine_steps_under_its_busy_neighbours_contention(tmp_path: Path) -> None:
    core = EngineCore(perf_model("llama-3.2-1b", "a6000", share=0.5))
    me = Neighbours(tmp_path, [0], 0.5)
    other = Neighbours(tmp_path, [0], 0.5)
    before_step, on_idle = attach(core, me)
    before_step()
    assert (core.perf.compute_contention, core.perf.memory_contention) == (1.0, 1.0)
    other.busy_shares()  # the neighbour is working
    before_step()
    assert (core.perf.compute_contention, core.perf.memory_contention) == contention((0.5, 0.5))
    on_idle()
    assert other.busy_shares() == ()  # this engine went idle: it no longer slows the other
    me.close()
    other.close()
