"""The server processes of the proxy overhead benchmark: starting one, knowing when it is
ready, stopping it (its whole process tree), and reading what it printed.

A ``Server`` is a child process in its own session whose stdout/stderr go to files in a logs
folder; ``Placement`` says which cores the loaded server and everything else may use. Also here:
the request the servers are loaded with (``ROUTE``, ``BODY``, ``STREAM_BODY``), the command that
starts ``scepsy-proxy`` against the stub upstream, and the machine and upstream probes a phase
reads (idle CPUs, the upstream's POST counters, the proxy's ``recorder closed`` lines).

Invariants: a ``Server`` that did not become ready is killed before ``RuntimeError`` is raised,
so no started process outlives a failed start; ``kill`` reaps the whole session (supervisor and
workers), so every process tree this module starts is gone after it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.proxy._load import Cpus, popen
from bench.proxy.peers import SCEPSY

MODEL = "bench"
WORKFLOW = "bench"
ROUTE = "/v1/chat/completions"
BODY = orjson.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 16}
)
STREAM_BODY = orjson.dumps({**orjson.loads(BODY), "stream": True})
_LISTENING = {
    "upstream": re.compile(r"upstream listening on (\d+)"),
    SCEPSY: re.compile(r"scepsy-proxy listening on http://[^:]+:(\d+)"),
}
_RECORDER_CLOSED = re.compile(r"recorder closed: (\d+) written, (\d+) dropped")


@dataclass(frozen=True)
class Placement:
    """Which cores the loaded server and everything else (upstream, load generator) may use."""

    server: Cpus
    others: Cpus

    @staticmethod
    def choose(pin: bool) -> Placement:
        cpus = sorted(os.sched_getaffinity(0))
        if not pin or len(cpus) < 2:
            return Placement(None, None)
        return Placement(frozenset(cpus[:1]), frozenset(cpus[1:]))

    def describe(self) -> dict[str, Any]:
        return {
            "server_cpus": sorted(self.server) if self.server else "unpinned",
            "upstream_and_client_cpus": sorted(self.others) if self.others else "unpinned",
        }


class Server:
    """A server child process (its own session, so its whole tree can be killed) whose
    stdout/stderr go to files. Ready when it prints its port (``kind`` in ``_LISTENING``), or,
    given ``port``, when a POST of the benchmark's body to it answers 200."""

    def __init__(
        self,
        kind: str,
        cmd: list[str],
        cpus: Cpus,
        logs: Path,
        port: int | None = None,
        ready_s: float = 30.0,
    ) -> None:
        self.kind = kind
        self.cmd = cmd
        self.out = logs / f"{kind}.out"
        self.err = logs / f"{kind}.err"
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = popen(cmd, cpus, stdout=out, stderr=err, start_new_session=True)
        self.port = self._wait_ready(ready_s, port)

    def _wait_ready(self, timeout_s: float, port: int | None) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if port is not None and _answers(f"http://127.0.0.1:{port}{ROUTE}"):
                return port
            m = None if port is not None else _LISTENING[self.kind].search(self._text(self.out))
            if m:
                return int(m[1])
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        why = "exited" if self.proc.returncode is not None else f"not ready in {timeout_s:g} s"
        raise RuntimeError(f"{self.kind} did not start ({why}): {self._text(self.err)[-1500:]}")

    @staticmethod
    def _text(path: Path) -> str:
        return path.read_text(errors="replace")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int | None:
        """Signal the process and wait for it; kill its whole tree if it outlives
        ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the process's whole session (workers included) and reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _answers(url: str) -> bool:
    req = urllib.request.Request(url, BODY, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def idle_cpus(seconds: float = 0.5) -> float | None:
    """How many CPUs sat idle over ``seconds`` (from /proc/stat): other work on the machine
    competes with the benchmark, and this says how much there was."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    share = (idle1 - idle0) / max(1, total1 - total0)
    return round(share * (os.cpu_count() or 1), 2)


def upstream_stats(upstream: Server) -> dict[str, int]:
    with urllib.request.urlopen(upstream.url + "/stats", timeout=5) as r:
        return {k: int(v) for k, v in orjson.loads(r.read()).items()}


def recorder_totals(stderr: str) -> dict[str, int] | None:
    """The ``recorder closed: N written, M dropped`` lines of a proxy's stderr (one per
    worker, and one in all for a single process), summed; None when there is none."""
    lines = _RECORDER_CLOSED.findall(stderr)
    if not lines:
        return None
    return {
        "written": sum(int(w) for w, _ in lines),
        "dropped": sum(int(d) for _, d in lines),
        "recorders": len(lines),
    }


def scepsy_command(upstream: Server, store: Path, place: Placement, logs: Path) -> list[str]:
    """The proxy as shipped (default workers); pinned, one worker on its one core."""
    cmd = [sys.executable, "-m", "proxy.cli", "--listen", "127.0.0.1:0"]
    cmd += ["--upstream", f"{MODEL}={upstream.url}", "--store", str(store)]
    cmd += ["--workflow", WORKFLOW, "--log-level", "INFO"]
    if place.server is not None:
        config = logs / "one-worker.yaml"
        config.write_text("proxy:\n  workers: 1\n")
        cmd += ["--config", str(config)]
    return cmd


def worker_count(server: Server) -> int | None:
    """How many workers the proxy said it started (1 for a single process); None
    when it printed nothing."""
    m = re.search(r"\((\d+) workers", server.out.read_text(errors="replace"))
    return int(m[1]) if m else 1 if server.out.stat().st_size else None
