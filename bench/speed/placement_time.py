"""Benchmark: how long topology-aware placement (``optimizer.placement.place``) takes.

``python -m bench.speed.placement_time --out DIR [--quick]`` writes ``DIR/placement_time.json``.

The cluster: nodes of 8 GPUs, alternately one 8-GPU NVLink domain (H100, NVSwitch-like) and four
NVLink pairs (A6000, the paper's bridged pairs). The demands, per 4 nodes (32 GPUs, 15 replicas):
one TP8 group, one TP4 group at share 0.5, TP2 groups whole and at 0.6, whole GPUs, and sub-GPU
shares from 0.1 to 0.7: 21.4 GPU-equivalents (67% of the capacity), given in a shuffled order. The
headline point is 16 nodes / 128 GPUs / 60 replicas; target: under 100 ms. Timings include the
invariant check ``place`` runs on every result. Pure computation: no GPU is involved.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from pathlib import Path

import orjson

from optimizer.placement import ReplicaDemand, place
from shared.cluster import GB, Cluster, Gpu, Node, NvlinkDomain

TARGET_S = 0.1


def cluster(nodes: int) -> Cluster:
    out = []
    for n in range(nodes):
        if n % 2 == 0:
            groups = [tuple(range(8))]
            gpu_type, memory = "h100", 80 * GB
        else:
            groups = [(0, 1), (2, 3), (4, 5), (6, 7)]
            gpu_type, memory = "a6000", 48 * GB
        domains = tuple(NvlinkDomain(tuple(Gpu(i, gpu_type, memory) for i in g)) for g in groups)
        out.append(Node(f"node-{n}", domains))
    return Cluster(tuple(out))


# (model, tp, share, count, memory floor GB) per block of 4 nodes: 15 replicas, 21.4 GPUs.
BLOCK = (
    ("llama-70b", 8, 1.0, 1, 150.0),
    ("qwen-32b", 4, 0.5, 1, 70.0),
    ("llama-8b", 2, 1.0, 2, 20.0),
    ("prm-8b", 2, 0.6, 2, 20.0),
    ("llama-3b", 1, 1.0, 3, 8.0),
    *(("e5-base", 1, share, 1, 1.0) for share in (0.1, 0.2, 0.3, 0.5, 0.7, 0.2)),
)


def demands(nodes: int, seed: int = 0) -> list[ReplicaDemand]:
    """15 replicas per 4 nodes (60 for 16 nodes), shuffled."""
    out = [
        ReplicaDemand(f"wf{block % 3}", model, tp, share, None, int(floor_gb * GB))
        for block in range(nodes // 4)
        for model, tp, share, count, floor_gb in BLOCK
        for _ in range(count)
    ]
    random.Random(seed).shuffle(out)
    return out


def measure(nodes: int, repeats: int) -> dict[str, float | int]:
    c, ds = cluster(nodes), demands(nodes)
    place(c, ds)  # warm up, and fail loudly if the scenario does not fit
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        place(c, ds)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "nodes": nodes,
        "gpus": c.gpu_count,
        "replicas": len(ds),
        "gpu_equivalents": round(sum(d.size for d in ds), 2),
        "repeats": repeats,
        "seconds_min": times[0],
        "seconds_median": statistics.median(times),
        "seconds_p90": times[int(0.9 * (len(times) - 1))],
        "seconds_max": times[-1],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="fewer repeats and sizes")
    args = ap.parse_args(argv)
    sizes = [4, 16] if args.quick else [4, 8, 16, 32, 64]
    repeats = 10 if args.quick else 50
    points = [measure(n, repeats) for n in sizes]
    headline = next(p for p in points if p["gpus"] == 128)
    doc = {
        "benchmark": "placement_time",
        "note": "pure computation on this machine's CPU; no GPU involved",
        "machine": {
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "points": points,
        "summary": {
            "gpus128_replicas60_seconds": headline["seconds_median"],
            "gpus128_replicas60_seconds_max": headline["seconds_max"],
            "target_seconds": TARGET_S,
            "meets_target": headline["seconds_max"] < TARGET_S,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "placement_time.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    for p in points:
        print(
            f"{p['gpus']:4d} GPUs {p['replicas']:4d} replicas: median "
            f"{float(p['seconds_median']) * 1e3:7.2f} ms, max {float(p['seconds_max']) * 1e3:7.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
