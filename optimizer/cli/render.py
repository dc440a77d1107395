"""``scepsy render``: the Kubernetes manifests of a configured allocation, written to a folder.

Role: the dry-run edge of the kubernetes backend. Reads the settings file (cluster, ``rollout``
models and allocation, or ``--scenario NAME`` for one of ``rollout.scenarios``), places the
allocation's replicas on the cluster, and writes one YAML file per object plus a
``kustomization.yaml`` listing them, so ``kubectl apply --server-side -k DIR`` applies what the
backend would. Prints the placement. Bad settings or an allocation that does not fit: one line
on stderr, exit status 2, nothing written.

:func:`target_for` (settings → placement → target groups) is shared with ``scepsy allocate``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from optimizer.placement import Placement, PlacementError, ReplicaDemand, place
from optimizer.plan import target as plan_target
from optimizer.plan.target import GroupSpec
from optimizer.rollout.kube import render
from shared.cluster import GB, Cluster, ClusterError, cluster_from_settings
from shared.rollout_settings import AllocationEntry, RolloutSettings
from shared.settings import load_settings
from shared.settings_schema import SettingsError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True, help="settings YAML file")
    parser.add_argument("--out", type=Path, required=True, help="folder to write manifests to")
    parser.add_argument(
        "--scenario", help="a named allocation of rollout.scenarios (default: rollout.allocation)"
    )


def demands(
    rollout: RolloutSettings, allocation: tuple[AllocationEntry, ...]
) -> list[ReplicaDemand]:
    """One placement demand per replica of the allocation (memory in proportion to share)."""
    return [
        ReplicaDemand(
            e.workflow, e.model, e.tp, e.share, None, rollout.model(e.model).min_memory_bytes
        )
        for e in allocation
        for _ in range(e.replicas)
    ]


def target_for(
    cluster: Cluster, rollout: RolloutSettings, scenario: str | None
) -> tuple[Placement, tuple[GroupSpec, ...]]:
    """Place the allocation called ``scenario`` and group it; raises on misfit."""
    allocation = rollout.scenario(scenario)
    if not allocation:
        where = f"scenario {scenario!r}" if scenario else "rollout.allocation"
        raise SettingsError(where, "is empty: nothing to place")
    placement = place(cluster, demands(rollout, allocation))
    return placement, plan_target.target_from_placement(placement, rollout.revisions())


def _table(target: tuple[GroupSpec, ...]) -> Table:
    out = Table(title="placement (one pod per GPU group)", title_justify="left")
    for col in ("pod group", "node", "GPUs", "model", "tp", "share", "memory GB/GPU"):
        out.add_column(col)
    for g in target:
        for r in g.replicas:
            out.add_row(
                g.id,
                g.node,
                ",".join(map(str, r.spec.gpus)),
                r.spec.model,
                str(r.spec.tp),
                f"{r.spec.share:.0%}",
                f"{r.spec.memory_bytes_per_gpu / GB:.1f}",
            )
    return out


def write_manifests(objects: list[dict[str, Any]], out: Path) -> list[Path]:
    """One file per object (``<kind>-<name>.yaml``) and a kustomization listing them."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for obj in objects:
        path = out / f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(obj, sort_keys=False))
        paths.append(path)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [p.name for p in paths],
    }
    (out / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return paths


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
        rollout = settings.rollout
        cluster = cluster_from_settings(settings.cluster)
        _, target = target_for(cluster, rollout, args.scenario)
        objects = render.render_target(target, rollout, cluster)
    except (SettingsError, ClusterError, PlacementError) as exc:
        print(f"scepsy render: {exc}", file=sys.stderr)
        return 2
    try:
        paths = write_manifests(objects, args.out)
    except OSError as exc:
        print(f"scepsy render: cannot write to {args.out}: {exc.strerror}", file=sys.stderr)
        return 1
    console = Console()
    console.print(_table(target))
    console.print(
        f"wrote {len(paths)} objects and kustomization.yaml to {args.out} "
        f"(apply with: kubectl apply --server-side -k {args.out})"
    )
    return 0
