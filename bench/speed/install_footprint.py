"""What each install of Scepsy puts on disk: the sidecar alone, the optimizer, the demo.

Role: the proxy runs as a sidecar beside every agent pod, so its install is paid once per pod;
it must carry only what ``proxy/`` and ``shared/`` import (DESIGN §5). This benchmark builds one
fresh virtual environment per install spec (``pip install -e SPEC`` from this checkout, as the
README says), and reports the size of its ``site-packages`` and the distributions it holds.
``--ref REV`` measures a git revision's bare install too (a clone of this repository at REV),
for a before/after figure.

    python -m bench.speed.install_footprint --out DIR [--ref REV]

Writes ``DIR/install_footprint.json``. Sizes are MiB on this file system (``du``-like: file
sizes rounded up to 4 KiB blocks), pip caches excluded.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[2]
SPECS = {"sidecar": "", "optimizer": "[optimizer]", "demo": "[demo]"}


def _mib(folder: Path) -> float:
    blocks = sum(-(-p.stat().st_size // 4096) for p in folder.rglob("*") if p.is_file())
    return round(blocks * 4096 / 2**20, 1)


def measure(project: Path, extra: str, work: Path) -> dict[str, Any]:
    venv = work / f"venv{extra or '-bare'}"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    started = time.monotonic()
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "-e", f"{project}{extra}"],
        check=True,
        capture_output=True,
    )
    took = time.monotonic() - started
    freeze = subprocess.run(
        [str(venv / "bin" / "pip"), "list", "--format", "freeze"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    site = next((venv / "lib").glob("python3*/site-packages"))
    return {
        "site_packages_mib": _mib(site),
        "distributions": len(freeze),
        "install_s": round(took, 1),
        "heavy": sorted(
            d.split("==")[0]
            for d in freeze
            if d.split("==")[0].lower()
            in {"kubernetes", "matplotlib", "rich", "openai", "pynvml", "nvidia-ml-py"}
        ),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ref", help="also measure this git revision's bare install")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"python": sys.version.split()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, extra in SPECS.items():
            result[name] = measure(ROOT, extra, work)
            print(f"{name}: {result[name]['site_packages_mib']} MiB", file=sys.stderr)
        if args.ref:
            old = work / "ref"
            subprocess.run(["git", "clone", "-q", str(ROOT), str(old)], check=True)
            subprocess.run(["git", "-C", str(old), "checkout", "-q", args.ref], check=True)
            result[f"sidecar_at_{args.ref}"] = measure(old, "", work / "old")
    args.out.mkdir(parents=True, exist_ok=True)
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2)
    (args.out / "install_footprint.json").write_bytes(text)
    print(text.decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
