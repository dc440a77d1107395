"""``scepsy inventory``: this node's GPUs and NVLink domains, as a table and as settings YAML.

Role: the presentation edge of :mod:`shared.inventory`. Prints one row per GPU (node, NVLink
domain, index, type, memory) and writes the ``cluster:`` settings section to ``--out`` (or prints
it after the table). Without an NVIDIA driver it says so in one line on stderr and exits 1;
nothing is written then.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from shared.cluster import GB, Cluster
from shared.inventory import InventoryError, read_node, render_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="write the cluster: settings section here")
    parser.add_argument("--node-name", help="the node's name in the settings (default: host name)")


def table(cluster: Cluster) -> Table:
    out = Table(title="GPU inventory (NVML)", title_justify="left")
    for col in ("node", "NVLink domain", "GPU", "type", "memory GB"):
        out.add_column(col, justify="right" if col in ("GPU", "memory GB") else "left")
    for node in cluster.nodes:
        for d, domain in enumerate(node.domains):
            for gpu in domain.gpus:
                out.add_row(
                    node.name,
                    f"{d} ({domain.size} GPU)",
                    str(gpu.index),
                    gpu.type,
                    f"{gpu.memory_bytes / GB:.1f}",
                )
    return out


def run(args: argparse.Namespace, nvml: Any = None) -> int:
    """``nvml``: the NVML binding (default ``pynvml``); tests pass a fake module object."""
    try:
        cluster = Cluster((read_node(nvml, node_name=args.node_name),))
    except InventoryError as exc:
        print(f"scepsy inventory: {exc}", file=sys.stderr)
        return 1
    console = Console()
    console.print(table(cluster))
    text = render_settings(cluster)
    if args.out is None:
        console.print("# settings (write them to a file with --out FILE)")
        print(text, end="")
        return 0
    try:
        args.out.write_text(text)
    except OSError as exc:
        print(f"scepsy inventory: cannot write {args.out}: {exc.strerror}", file=sys.stderr)
        return 1
    console.print(f"wrote the cluster settings to {args.out}")
    return 0
