"""The proxy as a child process (``python -m proxy.cli``), for tests that signal or kill it.

Role: start the real command line on a free loopback port with a ``--config`` YAML file, wait
for its "listening on" line, and make sure it is gone when the test ends (killed in a
``finally`` if the test did not stop it). Its stderr goes to a file, shown in failures.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shared.ports import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class ProxyProcess:
    proc: asyncio.subprocess.Process
    url: str
    store: Path
    log: Path

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    async def exit_code(self, limit_s: float) -> int:
        try:
            return await asyncio.wait_for(self.proc.wait(), limit_s)
        except TimeoutError:
            raise AssertionError(
                f"proxy still running after {limit_s}s:\n{self.stderr()}"
            ) from None


@asynccontextmanager
async def proxy_process(
    tmp_path: Path, upstream: str, settings: dict[str, Any]
) -> AsyncIterator[ProxyProcess]:
    """The proxy for model ``m`` at ``upstream``, store ``tmp_path/store``, default workflow
    ``wf``, with ``settings`` as its --config file (the flags override it; ``proxy.workers``
    is 1 unless ``settings`` names it)."""
    store = tmp_path / "store"
    config = tmp_path / "proxy.yaml"
    # One process unless the test asks for workers: the fault tests kill the one that records.
    doc = {**settings, "proxy": {"workers": 1, **settings.get("proxy", {})}}
    config.write_text(yaml.safe_dump(doc))
    port = free_port()
    args = ["--config", str(config), "--listen", f"127.0.0.1:{port}"]
    args += ["--upstream", f"m={upstream}", "--store", str(store), "--workflow", "wf"]
    log = tmp_path / "proxy.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy.cli",
            *args,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
    handle = ProxyProcess(proc, f"http://127.0.0.1:{port}", store, log)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert b"listening on" in line, f"{line!r}\n{handle.stderr()}"
        yield handle
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
