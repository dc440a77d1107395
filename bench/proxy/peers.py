"""The servers the proxy overhead benchmark compares: the Scepsy proxy and its peers.

Role: for each server, the command line that starts it the way its users run it, in front of
one engine URL, and whether it is installed here. The peers are the vLLM router (PyPI
``vllm-router``) and the SGLang model gateway (PyPI ``sglang-router``), both installed by the
``peers`` extra (``pip install -e '.[peers]'``).

Invariants:
- every server gets the same single engine URL as its only worker/backend and is left on its
  default routing policy (both peers: ``cache_aware``; the proxy: ``least_outstanding``) and its
  default log level; the only other flags are addresses (the peers' Prometheus port is a free
  port instead of their fixed default 29000, so that runs side by side do not collide);
- a peer that is not installed is reported by :func:`missing`, never started;
- nothing here pins or limits a server: the caller chooses cores (as shipped: none).
"""

from __future__ import annotations

import importlib.metadata
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from shared.ports import free_port

SCEPSY = "scepsy"


@dataclass(frozen=True)
class Peer:
    """A router started from its console script: ``exe [subcommand] --host --port
    --worker-urls URL --prometheus-port P``."""

    name: str
    package: str  # the PyPI distribution that installs it
    script: str  # its console script
    subcommand: tuple[str, ...]
    policy: str  # its default policy, which the benchmark keeps
    notes: str

    def executable(self) -> str | None:
        """The console script beside this interpreter (the venv's), else on PATH."""
        beside = Path(sys.executable).parent / self.script
        return str(beside) if beside.exists() else shutil.which(self.script)

    def version(self) -> str | None:
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None

    def missing(self) -> str | None:
        """Why this peer cannot run here, or None."""
        if self.version() is None or self.executable() is None:
            return "not installed"
        return None

    def command(self, upstream_url: str, port: int) -> list[str]:
        exe = self.executable()
        if exe is None:
            raise RuntimeError(f"{self.name} is not installed")
        cmd = [exe, *self.subcommand, "--host", "127.0.0.1", "--port", str(port)]
        return [*cmd, "--worker-urls", upstream_url, "--prometheus-port", str(free_port())]


PEERS = (
    Peer(
        name="vllm-router",
        package="vllm-router",
        script="vllm-router",
        subcommand=(),
        policy="cache_aware",
        notes="default policy cache_aware asks the engine's /v1/chat/completions/render for "
        "the prompt's token ids before each call (one more engine round trip per call)",
    ),
    Peer(
        name="sglang-router",
        package="sglang-router",
        script="sglang-router",
        subcommand=("launch",),
        policy="cache_aware",
        notes="default policy cache_aware on the request text; logs two INFO lines per call",
    ),
)
