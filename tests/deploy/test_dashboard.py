"""deploy/: the dashboard queries only exported metrics; kustomize files parse and resolve
(building and validating them: test_manifests)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared import metric_names

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXPORTED = set(metric_names.PROXY_METRICS) | set(metric_names.OPTIMIZER_METRICS)
# Series a histogram exports besides its name.
SUFFIXES = ("_bucket", "_sum", "_count")
NAME = re.compile(r"\bscepsy_[a-z0-9_]+")


def queries() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana" / "scepsy-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def exported(name: str) -> bool:
    return name in EXPORTED or any(
        name.endswith(s) and name.removesuffix(s) in EXPORTED for s in SUFFIXES
    )


def test_every_query_names_only_exported_metrics() -> None:
    found = queries()
    assert found
    for title, expr in found:
        names = NAME.findall(expr)
        assert names, f"{title}: query names no scepsy metric: {expr}"
        unknown = [n for n in names if not exported(n)]
        assert not unknown, f"{title}: {unknown} not in shared.metric_names"


def test_every_exported_metric_has_a_panel() -> None:
    used = {n for _, expr in queries() for n in NAME.findall(expr)}
    used |= {n.removesuffix(s) for n in used for s in SUFFIXES if n.endswith(s)}
    assert EXPORTED - used == set()


def test_metric_names_follow_the_conventions() -> None:
    for name in EXPORTED:
        assert name.startswith(("scepsy_proxy_", "scepsy_optimizer_")), name
    assert metric_names.OPTIMIZER_ROLLOUTS.endswith("_total")
    assert metric_names.OPTIMIZER_SEARCH_DURATION.endswith("_seconds")


def kustomizations() -> list[Path]:
    return sorted(DEPLOY.rglob("kustomization.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kustomization_references_existing_parsable_files(path: Path) -> None:
    (k,) = documents(path)
    files = list(k.get("resources", []))
    for gen in k.get("configMapGenerator", []) + k.get("secretGenerator", []):
        files += [f.split("=", 1)[-1] for f in gen.get("files", [])]
    assert files
    for name in files:
        target = path.parent / name
        assert target.exists(), f"{path}: {name} does not exist"
        if target.is_file() and name in k.get("resources", []):
            for doc in documents(target):
                assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{target}: not an object"


def test_optimizer_role_grants_only_what_the_kube_backend_uses() -> None:
    role = next(d for d in documents(DEPLOY / "optimizer.yaml") if d["kind"] == "Role")
    granted = {
        (res, verb) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]
    }
    assert all(rule["apiGroups"] == [""] for rule in role["rules"])
    assert {res for res, _ in granted} == {"pods", "services", "configmaps"}
    assert ("configmaps", "delete") not in granted
    assert not {verb for _, verb in granted} - {"get", "list", "watch", "create", "patch", "delete"}


def test_scrape_config_parses() -> None:
    (scrape,) = documents(DEPLOY / "prometheus" / "scrape.yaml")
    jobs = {j["job_name"] for j in scrape["scrape_configs"]}
    assert jobs == {"scepsy-proxy", "scepsy-optimizer", "scepsy-engines"}
