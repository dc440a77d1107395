"""Engine processes of the local backend: what to launch, the state folder, and process control.

Role: three concerns the local backend (:mod:`optimizer.rollout.local.backend`) composes.
- :func:`launches` (pure): the processes of one GPU group (an MPS control daemon when
  vllm/sglang engines share GPUs, then one engine per replica) with their command lines (from
  :func:`optimizer.rollout.kube.render.engine_command`) and environment (GPU ids, MPS limits) taken from
  the placement.
- :class:`StateDir`: one JSON file per running group (its :class:`GroupSpec` and the record of
  each process: port, URL, pid, the pid's start time, log file), written atomically, so a
  restarted daemon finds the engines it left running.
- process control: :func:`spawn` (own session, so engines outlive the daemon; stdout and stderr
  to a log file), :func:`alive`, :func:`terminate` (SIGTERM to the process group, SIGKILL after
  a grace), reaping.

Invariants:
- a process record is written *before* its process is spawned (without a pid) and completed
  right after; a spawned process carries ``SCEPSY_LOCAL_STATE`` (the state folder) and
  ``SCEPSY_LAUNCH`` (the record's token) in its environment, so a daemon killed between the two
  writes still finds it (:func:`find_tagged`) instead of starting a duplicate;
- a pid is trusted only together with its start time from ``/proc/<pid>/stat``: a reused pid
  or a zombie counts as dead, and is never signalled;
- under MPS the control daemon sees the group's GPUs and remaps them, so an engine names its
  GPUs by their position in the group (NVIDIA MPS docs); without MPS by their NVML index, both
  in PCI bus order.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import orjson

from optimizer.plan.target import GroupSpec, ReplicaSpec, TargetReplica
from optimizer.rollout.kube.render import MIB, engine_command
from shared.cluster import Cluster
from shared.rollout_settings import LocalSettings, RolloutSettings

__all__ = [
    "ENV_LAUNCH",
    "ENV_STATE",
    "GroupRecord",
    "Launch",
    "ProcRecord",
    "StateDir",
    "alive",
    "find_tagged",
    "launches",
    "log_tail",
    "spawn",
    "start_time",
    "terminate",
    "uses_mps",
]

ENV_STATE = "SCEPSY_LOCAL_STATE"
ENV_LAUNCH = "SCEPSY_LAUNCH"

Role = Literal["engine", "mps"]


@dataclass(frozen=True)
class Launch:
    """One process to start: an engine (``name`` = replica id) or a group's MPS daemon."""

    role: Role
    name: str
    model: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    port: int = 0


def uses_mps(group: GroupSpec, rollout: RolloutSettings) -> bool:
    """Shared GPUs with a real engine on them; emulated engines use no GPU, hence no MPS."""
    return group.shared and any(
        rollout.model(r.spec.model).engine != "emulator" for r in group.replicas
    )


def mps_dirs(state: Path, group_id: str) -> tuple[Path, Path]:
    """The MPS pipe and log folders of a group."""
    return state / "mps" / group_id / "pipe", state / "mps" / group_id / "log"


def _local_argv(cmd: Sequence[str], engine: str, host: str) -> tuple[str, ...]:
    """The template's command with this machine's listen address; the emulator from this
    interpreter (``scepsy-engine`` may not be on PATH where the daemon runs)."""
    argv = list(cmd)
    if "--host" in argv:
        argv[argv.index("--host") + 1] = host
    if engine == "emulator" and argv[0] == "scepsy-engine":
        argv[:1] = [sys.executable, "-m", "sim.cli"]
    return tuple(argv)


def launches(
    group: GroupSpec,
    rollout: RolloutSettings,
    cluster: Cluster,
    ports: Mapping[str, int],
    state: Path,
) -> list[Launch]:
    """The group's processes, the MPS daemon first; ``ports``: per replica id."""
    local = rollout.local
    mps = uses_mps(group, rollout)
    pipe, log = mps_dirs(state, group.id)
    order = [("CUDA_DEVICE_ORDER", "PCI_BUS_ID")]
    mps_env = [("CUDA_MPS_PIPE_DIRECTORY", str(pipe)), ("CUDA_MPS_LOG_DIRECTORY", str(log))]
    out: list[Launch] = []
    if mps:
        out.append(
            Launch(
                "mps",
                group.id,
                "",
                tuple(local.mps_control),
                tuple([*order, ("CUDA_VISIBLE_DEVICES", ",".join(map(str, group.gpus))), *mps_env]),
            )
        )
    node = cluster.node(group.node)
    for r in group.replicas:
        spec, serving = r.spec, rollout.model(r.spec.model)
        gpu = node.gpu(spec.gpus[0])
        argv = _local_argv(
            engine_command(serving, spec, ports[r.id], gpu.type, gpu.memory_bytes),
            serving.engine,
            local.host,
        )
        if serving.engine == "emulator":  # emulated engines on one GPU contend for it
            board = state / "gpus" / group.node
            argv = (*argv, "--gpu-board", str(board), "--gpu-ids", ",".join(map(str, spec.gpus)))
        visible = [group.gpus.index(g) for g in spec.gpus] if mps else list(spec.gpus)
        env = [*order, ("CUDA_VISIBLE_DEVICES", ",".join(map(str, visible)))]
        if spec.share < 1.0 - 1e-9:
            limit = ",".join(f"{i}={spec.memory_bytes_per_gpu // MIB}M" for i in range(spec.tp))
            env += [
                ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(max(1, round(spec.share * 100)))),
                ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", limit),
            ]
        if mps:
            env += mps_env
        out.append(Launch("engine", r.id, spec.model, argv, tuple(env), ports[r.id]))
    return out


# --- state folder ------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcRecord:
    """One process of a group; ``pid`` is None between the record's first write and the spawn."""

    role: Role
    name: str
    model: str
    port: int
    url: str
    token: str
    log: str
    pid: int | None = None
    pid_start: int | None = None
    started_at: float = 0.0


@dataclass(frozen=True)
class GroupRecord:
    group: GroupSpec
    procs: tuple[ProcRecord, ...] = ()
    created_at: float = 0.0

    def engine(self, replica_id: str) -> ProcRecord | None:
        return next((p for p in self.procs if p.role == "engine" and p.name == replica_id), None)

    def mps(self) -> ProcRecord | None:
        return next((p for p in self.procs if p.role == "mps"), None)

    def with_proc(self, proc: ProcRecord) -> GroupRecord:
        others = tuple(p for p in self.procs if (p.role, p.name) != (proc.role, proc.name))
        return replace(self, procs=(*others, proc))

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, data: bytes) -> GroupRecord:
        raw = orjson.loads(data)
        g = raw["group"]
        group = GroupSpec(
            g["id"],
            g["node"],
            tuple(g["gpus"]),
            tuple(
                TargetReplica(
                    r["id"], ReplicaSpec(**{**r["spec"], "gpus": tuple(r["spec"]["gpus"])})
                )
                for r in g["replicas"]
            ),
        )
        return cls(group, tuple(ProcRecord(**p) for p in raw["procs"]), raw["created_at"])


class StateDir:
    """``<dir>/groups/<group id>.json`` per running group, ``<dir>/routes.json`` (the last route
    table pushed), ``<dir>/logs/`` unless configured elsewhere, ``<dir>/mps/<group id>/``."""

    def __init__(self, local: LocalSettings) -> None:
        self.path = Path(local.state_dir).expanduser().resolve()
        self.groups = self.path / "groups"
        self.logs = (
            Path(local.log_dir).expanduser().resolve() if local.log_dir else self.path / "logs"
        )
        self.routes = self.path / "routes.json"
        for d in (self.groups, self.logs):
            d.mkdir(parents=True, exist_ok=True)

    def _write(self, path: Path, data: bytes) -> None:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # atomic: a reader never sees half a file

    def load(self) -> dict[str, GroupRecord]:
        out: dict[str, GroupRecord] = {}
        for f in sorted(self.groups.glob("*.json")):
            try:
                rec = GroupRecord.from_json(f.read_bytes())
            except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
                # A file we cannot read is left for a human; its engines are not adopted.
                raise ValueError(f"unreadable state file {f}: {exc}") from exc
            out[rec.group.id] = rec
        return out

    def get(self, group_id: str) -> GroupRecord | None:
        return self.load().get(group_id)

    def save(self, rec: GroupRecord) -> None:
        self._write(self.groups / f"{rec.group.id}.json", rec.to_json())

    def remove(self, group_id: str) -> None:
        (self.groups / f"{group_id}.json").unlink(missing_ok=True)

    def save_routes(self, table: Sequence[Mapping[str, Any]]) -> None:
        self._write(self.routes, orjson.dumps({"upstreams": list(table)}))

    def load_routes(self) -> list[dict[str, Any]]:
        try:
            table: list[dict[str, Any]] = orjson.loads(self.routes.read_bytes())["upstreams"]
            return table
        except (OSError, orjson.JSONDecodeError, KeyError):
            return []


# --- processes ---------------------------------------------------------------------------

# Spawned children by pid, process-wide: a child belongs to this process, not to one backend
# object, so a backend created after another was abandoned (a cancelled rollout) still reaps it.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), or None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # the name may hold spaces and parentheses
    if fields[0] in (b"Z", b"X"):
        _reap(pid)
        return None
    return int(fields[19])


def alive(proc: ProcRecord) -> bool:
    return proc.pid is not None and start_time(proc.pid) == proc.pid_start


def _reap(pid: int) -> None:
    child = _CHILDREN.pop(pid, None)
    if child is not None:
        child.poll()
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: init reaps it


def find_tagged(state: Path, token: str | None = None) -> dict[int, str]:
    """Live processes whose environment names the state folder ``state`` (and, if given, the
    launch ``token``): pid -> token."""
    want = f"{ENV_STATE}={state}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone, or another user's
        if want not in env:
            continue
        tag = next(
            (
                e[len(ENV_LAUNCH) + 1 :].decode()
                for e in env
                if e.startswith(f"{ENV_LAUNCH}=".encode())
            ),
            "",
        )
        if (token is None or tag == token) and start_time(int(entry.name)) is not None:
            found[int(entry.name)] = tag
    return found


def new_token() -> str:
    return secrets.token_hex(8)


def spawn(launch: Launch, record: ProcRecord, state: Path) -> ProcRecord:
    """Start ``launch`` in a session of its own (it outlives the daemon; its process group is
    its pid), output appended to ``record.log``; returns the record with the pid filled in."""
    env = {**os.environ, **dict(launch.env), ENV_STATE: str(state), ENV_LAUNCH: record.token}
    with open(record.log, "ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(launch.argv)}\n".encode())
        log.flush()
        try:
            child = subprocess.Popen(
                launch.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise OSError(f"cannot start {launch.argv[0]}: {exc}") from exc
    _CHILDREN[child.pid] = child
    _await_exec(child.pid)
    return replace(record, pid=child.pid, pid_start=start_time(child.pid), started_at=time.time())


def _await_exec(pid: int, limit_s: float = 2.0) -> None:
    """Wait (milliseconds) until the new program's environment shows in ``/proc``: Popen returns
    as soon as the exec passed its point of no return, while ``environ`` still reads empty, and
    :func:`find_tagged` must see the tag of every process it is asked about."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/environ").read_bytes():
                return
        except OSError:
            return  # gone already; the caller finds out
        time.sleep(0.001)


def _signal_group(proc: ProcRecord, sig: signal.Signals) -> None:
    """Signal the process group of a recorded leader. A leader that exited may leave children
    (vLLM's workers) in its group; the kernel does not hand out a pid still used as a process
    group id, so a group that exists under a dead leader's pid is still that leader's."""
    if proc.pid is None or not (alive(proc) or _group_exists(proc.pid)):
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


async def terminate(
    procs: Iterable[ProcRecord],
    grace_s: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 0.05,
) -> None:
    """SIGTERM each process group, wait up to ``grace_s`` for the leaders to exit, then SIGKILL
    what is left; returns once every leader is gone (and reaped, where it is our child)."""
    procs = [p for p in procs if alive(p)]
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = clock() + grace_s
    while any(alive(p) for p in procs) and clock() < deadline:
        await sleep(poll_s)
    for p in procs:
        _signal_group(p, signal.SIGKILL)
    while any(alive(p) or (p.pid is not None and _group_exists(p.pid)) for p in procs):
        await sleep(poll_s)


def log_tail(path: str, lines: int = 5) -> str:
    """The last ``lines`` lines the latest run (after the last ``---`` header) wrote."""
    try:
        text = Path(path).read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return "(no log)"
    starts = [i for i, line in enumerate(text) if line.startswith("--- ")]
    run = text[starts[-1] + 1 :] if starts else text
    return " | ".join(run[-lines:]) or "(empty log)"
