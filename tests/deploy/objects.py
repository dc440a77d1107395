"""What the deploy tests look at: every built kustomization, the render output, the Dockerfile.

Role: shared by test_manifests and test_image. Kustomizations are built by the exact subset in
:mod:`tests.deploy.kustomize` (compared with ``kubectl kustomize`` where that is installed); ``scepsy render`` of examples/cluster.yaml (and
its emulated twin) into a temporary folder; the Dockerfile's targets and entry points.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from optimizer.cli import main as cli
from tests.deploy import kustomize

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
EXAMPLE = ROOT / "examples" / "cluster.yaml"
Obj = dict[str, Any]


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))


def build(root: Path) -> list[Obj]:
    """What ``kubectl kustomize root`` prints, built by the exact subset (test_manifests checks
    it equals kubectl's output where kubectl is installed)."""
    return kustomize.build(root)


def kubectl_build(root: Path) -> list[Obj] | None:
    """``kubectl kustomize root``, or None without kubectl."""
    if shutil.which("kubectl") is None:
        return None
    out = subprocess.run(
        ["kubectl", "kustomize", str(root)], capture_output=True, text=True, timeout=60, check=True
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render(out: Path, config: Path = EXAMPLE, *extra: str) -> list[Obj]:
    """The objects ``scepsy render --config CONFIG --out OUT`` writes."""
    assert cli.main(["render", "--config", str(config), "--out", str(out), *extra]) == 0
    names = yaml.safe_load((out / "kustomization.yaml").read_text())["resources"]
    return [yaml.safe_load((out / n).read_text()) for n in names]


def dockerfile_targets() -> dict[str, list[str]]:
    """Each named build stage with an ENTRYPOINT: stage name -> the entry point (exec form)."""
    targets: dict[str, list[str]] = {}
    stage: str | None = None
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    for line in lines:
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0].upper() == "FROM":
            stage = words[3] if len(words) >= 4 and words[2].upper() == "AS" else None
        elif words[0].upper() == "ENTRYPOINT" and stage is not None:
            entry = json.loads(line.split(None, 1)[1])
            assert isinstance(entry, list), f"ENTRYPOINT of {stage} must be the exec form"
            targets[stage] = entry
    return targets


def image_repo(image: str) -> str:
    """``registry/x/scepsy-proxy:0.1`` -> ``scepsy-proxy`` (the last path part, no tag)."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


def image_tag(image: str) -> str | None:
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[1] if ":" in name else None


def argv(container: Obj) -> list[str]:
    """The command line a container runs: its command, or its image's ENTRYPOINT, then args."""
    command = container.get("command")
    if command is None:
        target = image_repo(container["image"]).removeprefix("scepsy-")
        command = dockerfile_targets().get(target, [])
    return [*command, *container.get("args", [])]
