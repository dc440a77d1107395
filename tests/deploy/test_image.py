"""The images: the Dockerfile's targets run entry points the package installs, every manifest
names a target's image, their command lines parse, and the pins cover what each image imports."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from optimizer.cli import main as cli
from proxy import cli as proxy_cli
from shared.rollout_settings import KubernetesSettings
from sim import cli as sim_cli
from tests.deploy import kustomize
from tests.deploy.objects import (
    DEPLOY,
    ROOT,
    Obj,
    argv,
    build,
    dockerfile_targets,
    image_repo,
    image_tag,
    kustomization_dirs,
    render,
)

pytestmark = pytest.mark.timeout(120)

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SCRIPTS: dict[str, str] = PROJECT["scripts"]
VERSION: str = PROJECT["version"]
CONSTRAINTS = ROOT / "deploy" / "image" / "constraints.txt"
PIN = re.compile(r"^([A-Za-z0-9._-]+)==([^ ]+)  # (proxy|optimizer)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, tuple[str, str]]:
    """canonical name -> (version, image tag) of every line of constraints.txt."""
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        match = PIN.match(line)
        assert match, f"constraints.txt: not 'name==version  # proxy|optimizer': {line!r}"
        out[canonical(match[1])] = (match[2], match[3])
    return out


def containers(tmp: Path) -> list[tuple[str, Obj]]:
    found = []
    objects = {str(d.relative_to(DEPLOY)): build(d) for d in kustomization_dirs()}
    emulated = yaml.safe_load((ROOT / "examples" / "cluster.yaml").read_text())
    for m in emulated["rollout"]["models"]:
        m.update(engine="emulator", extra_args=[])
        m.pop("source", None)
    (tmp / "emulated.yaml").write_text(yaml.safe_dump(emulated))
    objects["render emulated"] = render(tmp / "out", tmp / "emulated.yaml")
    for where, objs in objects.items():
        for obj in objs:
            for spec in kustomize.pod_specs(obj):
                found += [(where, c) for c in kustomize.containers(spec)]
    return found


def test_the_dockerfile_has_the_two_targets_with_installed_entry_points() -> None:
    targets = dockerfile_targets()
    assert targets == {"proxy": ["scepsy-proxy"], "optimizer": ["scepsy"]}
    for entry in targets.values():
        assert entry[0] in SCRIPTS
    text = (ROOT / "Dockerfile").read_text()
    assert text.count("USER 65532:65532") == 2
    assert "--no-deps" in text and "--no-index" in text


def test_manifests_name_the_images_the_dockerfile_builds(tmp_path: Path) -> None:
    images = {f"scepsy-{t}" for t in dockerfile_targets()}
    seen = set()
    for where, c in containers(tmp_path):
        words = argv(c)
        ours = words[:1] and words[0] in SCRIPTS
        if image_repo(c["image"]).startswith("scepsy") or ours:
            assert image_repo(c["image"]) in images, f"{where}/{c['name']}: {c['image']}"
            assert image_tag(c["image"]) == VERSION, f"{where}/{c['name']}: {c['image']}"
            seen.add(image_repo(c["image"]))
    assert seen == images
    assert KubernetesSettings().emulator_image == f"scepsy-optimizer:{VERSION}"
    for d in kustomization_dirs():
        (k,) = kustomize.documents(d / "kustomization.yaml")
        for rule in k.get("images", []):
            assert rule["name"] in images and rule["newTag"] == VERSION, d


def test_every_scepsy_command_line_in_the_manifests_parses(tmp_path: Path) -> None:
    parsed = set()
    for where, c in containers(tmp_path):
        words = argv(c)
        if not words or words[0] not in SCRIPTS:
            continue
        try:
            if words[0] == "scepsy-proxy":
                proxy_cli._parser().parse_args(words[1:])
            elif words[0] == "scepsy":
                cli.build_parser(words[1]).parse_args(words[1:])
            else:
                assert words[0] == "scepsy-engine"
                sim_cli.parser().parse_args(words[1:])
        except SystemExit as exc:  # argparse's verdict on a bad command line
            raise AssertionError(f"{where}/{c['name']}: {words} does not parse") from exc
        parsed.add(words[0] if words[0] != "scepsy" else f"scepsy {words[1]}")
    assert parsed == {"scepsy-proxy", "scepsy run", "scepsy-engine"}


def test_constraints_pin_what_the_venv_has_for_each_image() -> None:
    pinned = pins()
    proxy = {n for n, (_, tag) in pinned.items() if tag == "proxy"}
    for req in PROJECT["dependencies"]:
        assert canonical(re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0]) in proxy, req
    for req in PROJECT["optional-dependencies"]["optimizer"]:
        assert canonical(re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0]) in pinned, req
    assert not proxy & {"kubernetes", "rich", "matplotlib", "nvidia-ml-py", "openai"}
    for name, (version, _) in pinned.items():
        assert metadata.version(name) == version, (
            f"{name}: pinned {version}, the venv has {metadata.version(name)}; "
            "run deploy/image/build.sh constraints"
        )


def module_imports(path: Path) -> set[str]:
    """Top-level names a module imports when it is imported (not inside functions)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        stmts = [node]
        if isinstance(node, ast.Try | ast.If):
            stmts = [*node.body, *(s for h in getattr(node, "handlers", []) for s in h.body)]
        for stmt in stmts:
            if isinstance(stmt, ast.Import):
                names |= {a.name.split(".")[0] for a in stmt.names}
            elif isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
                names.add(stmt.module.split(".")[0])
    return names


def test_the_proxy_image_holds_every_package_the_proxy_imports() -> None:
    providers = metadata.packages_distributions()
    proxy_pins = {n for n, (_, tag) in pins().items() if tag == "proxy"}
    local = {"proxy", "shared", "__future__"}
    for path in sorted(
        [*ROOT.joinpath("proxy").glob("*.py"), *ROOT.joinpath("shared").glob("*.py")]
    ):
        for name in module_imports(path) - local - set(sys.stdlib_module_names):
            dists = {canonical(d) for d in providers.get(name, [])}
            assert dists & proxy_pins, f"{path.name} imports {name}, not in the proxy image"
