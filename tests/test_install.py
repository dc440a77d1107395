"""The README's install commands in fresh virtual environments, as a new user runs them.

A venv with the test extra hides a missing runtime dependency (the demo's load drivers once died
on ``import openai`` in every fresh clone while the suite stayed green), so these tests build
their own venvs: the demo's (``-e '.[demo]'``, the README's first command) must import what the
demo runs; a wheel install (``'.[demo]'``, no link to the checkout) must hold the product
without the repository's ``bench`` and ``tests`` and still import, away from the checkout,
every module the demo starts; and the sidecar's (``-e .``) must serve without the optimizer's
packages and point at the right extra when an optimizer command needs one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What `scepsy demo` runs in its own process and in the processes it starts.
DEMO_MODULES = (
    "optimizer.demo.run",
    "optimizer.demo.report",
    "optimizer.rollout.local.backend",
    "examples.load",
    "proxy.cli",
    "sim.cli",
    "sim.profiles",
)
# In the repository, never installed: the benches run from its root (python -m bench....).
REPOSITORY_ONLY = ("bench", "tests")
OPTIMIZER_ONLY = ("kubernetes", "rich", "matplotlib", "openai", "pynvml")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _venv(path: Path, spec: str, *, editable: bool = True) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    pip = subprocess.run(
        [str(path / "bin" / "pip"), "install", "-q", *(["-e"] if editable else []), spec],
        capture_output=True,
        text=True,
        timeout=360,
        check=False,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    return path / "bin"


def _run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=kw.get("cwd", "/"),
        env=env,
    )


def test_the_readme_demo_install_runs_the_entry_points_and_imports_the_demo(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    assert "pip install -q -e '.[demo]' && .venv/bin/scepsy demo" in readme
    bin_ = _venv(tmp_path / "venv", f"{ROOT}[demo]")
    for command in ("scepsy", "scepsy-proxy", "scepsy-engine"):
        done = _run([str(bin_ / command), "--help"])
        assert done.returncode == 0, (command, done.stderr[-2000:])
    done = _run([str(bin_ / "scepsy"), "demo", "--help"])
    assert done.returncode == 0 and "--out" in done.stdout, done.stderr[-2000:]
    # The demo starts these with `python -m` from the project folder, as scepsy demo does.
    imports = "; ".join(f"import {m}" for m in DEMO_MODULES)
    done = _run([str(bin_ / "python"), "-c", imports], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_wheel_install_holds_no_bench_and_imports_what_the_demo_starts(tmp_path: Path) -> None:
    bin_ = _venv(tmp_path / "venv", f"{ROOT}[demo]", editable=False)
    for package in REPOSITORY_ONLY:
        done = _run([str(bin_ / "python"), "-c", f"import {package}"])
        assert done.returncode != 0, f"{package} is installed"
        assert f"No module named '{package}'" in done.stderr, done.stderr[-2000:]
    done = _run([str(bin_ / "scepsy"), "demo", "--help"])
    assert done.returncode == 0 and "--out" in done.stdout, done.stderr[-2000:]
    # Away from the checkout, every module resolves to the installed copy.
    imports = "; ".join(f"import {m}" for m in DEMO_MODULES)
    done = _run([str(bin_ / "python"), "-c", f"{imports}; print(optimizer.__file__)"])
    assert done.returncode == 0, done.stderr[-2000:]
    installed = Path(done.stdout.strip()).parents[1]
    assert installed.name == "site-packages", installed
    # The demo starts its processes from the folder its package came from: here site-packages.
    for module in ("sim.profiles", "sim.cli", "proxy.cli", "examples.load"):
        done = _run([str(bin_ / "python"), "-m", module, "--help"], cwd=installed)
        assert done.returncode == 0, (module, done.stderr[-2000:])


def test_the_sidecar_install_serves_without_the_optimizer_packages(tmp_path: Path) -> None:
    bin_ = _venv(tmp_path / "venv", str(ROOT))
    for module in OPTIMIZER_ONLY:
        done = _run([str(bin_ / "python"), "-c", f"import {module}"])
        assert done.returncode != 0, f"{module} is installed with the bare sidecar"
    done = _run([str(bin_ / "scepsy-proxy"), "--help-settings"])
    assert done.returncode == 0 and "proxy.listen" in done.stdout, done.stderr[-2000:]
    # An optimizer command names the extra it needs instead of printing a traceback.
    done = _run([str(bin_ / "scepsy"), "inventory"])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "pip install 'scepsy[optimizer]'" in done.stderr
    assert "Traceback" not in done.stderr
