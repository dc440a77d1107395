"""The cluster model and the ``cluster:`` settings section (both forms, key-path errors)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from shared.cluster import (
    GB,
    Cluster,
    ClusterError,
    ClusterSettings,
    Gpu,
    Node,
    NvlinkDomain,
    cluster_from_settings,
    settings_mapping,
)
from shared.settings_schema import SettingsError, decode


def parse(doc: Any) -> Cluster:
    return cluster_from_settings(decode(ClusterSettings, doc, "cluster"))


def test_explicit_nodes_with_domains_and_loose_gpus() -> None:
    cluster = parse(
        {
            "nodes": [
                {
                    "name": "n0",
                    "gpu_type": "a6000",
                    "gpus": 4,
                    "nvlink_domains": [[0, 1], [2, 3]],
                    "gpu_memory_gb": 48,
                },
                {"name": "n1", "gpu_type": "h100", "gpus": 3, "nvlink_domains": [[2, 0]]},
            ]
        }
    )
    n0, n1 = cluster.nodes
    assert [d.indices for d in n0.domains] == [(0, 1), (2, 3)]
    # A GPU in no listed domain is a domain of its own; indices sorted inside a domain.
    assert [d.indices for d in n1.domains] == [(0, 2), (1,)]
    assert n1.gpu(1) == Gpu(1, "h100", 80 * GB)
    assert n0.gpu(3).memory_bytes == 48 * GB
    assert cluster.gpu_count == 7
    assert cluster.max_domain_size == 2
    assert cluster.domain_sizes() == (2, 2, 2, 1)
    assert cluster.gpu_types == ("a6000", "h100")
    assert cluster.node("n1").domain_of(2).indices == (0, 2)
    assert [(name, g.index) for name, g in cluster.all_gpus()][:5] == [
        ("n0", 0),
        ("n0", 1),
        ("n0", 2),
        ("n0", 3),
        ("n1", 0),
    ]


def test_compact_form() -> None:
    cluster = parse(
        {"node_count": 2, "gpus_per_node": 4, "nvlink_domain_size": 2, "gpu_type": "a6000"}
    )
    assert [n.name for n in cluster.nodes] == ["node-0", "node-1"]
    assert cluster.domain_sizes() == (2, 2, 2, 2)
    assert cluster == Cluster.uniform(2, 4, 2, "a6000", 48 * GB)
    lone = parse({"node_count": 1, "gpus_per_node": 2, "gpu_type": "x", "gpu_memory_gb": 24.5})
    assert lone.max_domain_size == 1
    assert lone.nodes[0].gpus[0].memory_bytes == 24_500_000_000


@pytest.mark.parametrize(
    ("doc", "path"),
    [
        (
            {
                "nodes": [
                    {"name": "n", "gpu_type": "a6000", "gpus": 2, "nvlink_domains": [[0, 1], [1]]}
                ]
            },
            "cluster.nodes[0].nvlink_domains[1][0]",
        ),
        (
            {"nodes": [{"name": "n", "gpu_type": "a6000", "gpus": 2, "nvlink_domains": [[0, 2]]}]},
            "cluster.nodes[0].nvlink_domains[0][1]",
        ),
        (
            {"nodes": [{"name": "n", "gpu_type": "a6000", "gpus": 2, "nvlink_domains": [[]]}]},
            "cluster.nodes[0].nvlink_domains[0]",
        ),
        (
            {"nodes": [{"name": "n", "gpu_type": "mystery", "gpus": 2}]},
            "cluster.nodes[0].gpu_memory_gb",
        ),
        ({"nodes": [{"name": "n", "gpu_type": "a6000", "gpus": 0}]}, "cluster.nodes[0].gpus"),
        ({"nodes": [{"name": "n", "gpu_type": "a6000", "gpus": "four"}]}, "cluster.nodes[0].gpus"),
        (
            {
                "nodes": [
                    {"name": "n", "gpu_type": "a6000", "gpus": 1},
                    {"name": "n", "gpu_type": "a6000", "gpus": 1},
                ]
            },
            "cluster.nodes[1].name",
        ),
        (
            {"nodes": [{"name": "n", "gpu_type": "a6000", "gpus": 1, "gpu": 2}]},
            "cluster.nodes[0].gpu",
        ),
        (
            {"node_count": 2, "gpus_per_node": 4, "nvlink_domain_size": 3, "gpu_type": "a6000"},
            "cluster.nvlink_domain_size",
        ),
        ({"node_count": 2, "gpu_type": "a6000"}, "cluster.gpus_per_node"),
        ({"node_count": 2, "gpus_per_node": 4}, "cluster.gpu_type"),
        ({"node_count": 0, "gpus_per_node": 4, "gpu_type": "a6000"}, "cluster.node_count"),
        ({"gpus_per_node": 4}, "cluster.gpus_per_node"),
        ({"nvlink_domain_size": 2}, "cluster.nvlink_domain_size"),
        (
            {
                "node_count": 1,
                "gpus_per_node": 1,
                "gpu_type": "a6000",
                "nodes": [{"name": "n", "gpu_type": "a6000", "gpus": 1}],
            },
            "cluster.node_count",
        ),
        (
            {"node_count": 1, "gpus_per_node": 1, "gpu_type": "a6000", "gpu_memory_gb": -1},
            "cluster.gpu_memory_gb",
        ),
    ],
)
def test_errors_name_the_key_path(doc: dict[str, Any], path: str) -> None:
    with pytest.raises(SettingsError) as info:
        parse(doc)
    assert info.value.path == path


def test_unconfigured_cluster_says_how_to_configure_one() -> None:
    settings = decode(ClusterSettings, None)
    assert not settings.configured
    with pytest.raises(ClusterError, match="scepsy inventory"):
        cluster_from_settings(settings)


def test_settings_mapping_round_trips_through_yaml() -> None:
    memory = 51_527_024_640  # an A6000 as NVML reports it: not a round number of GB
    node = Node(
        "gpu-7",
        (
            NvlinkDomain((Gpu(0, "a6000", memory), Gpu(3, "a6000", memory))),
            NvlinkDomain((Gpu(1, "a6000", memory),)),
            NvlinkDomain((Gpu(2, "a6000", memory),)),
        ),
    )
    cluster = Cluster((node, *Cluster.uniform(1, 2, 2, "h100", 80 * GB).nodes))
    text = yaml.safe_dump({"cluster": settings_mapping(cluster)})
    assert parse(yaml.safe_load(text)["cluster"]) == cluster


def test_settings_mapping_refuses_what_settings_cannot_say() -> None:
    mixed = Node("m", (NvlinkDomain((Gpu(0, "a6000", 48 * GB), Gpu(1, "h100", 80 * GB))),))
    with pytest.raises(ClusterError, match="different types"):
        settings_mapping(Cluster((mixed,)))
    gap = Node("g", (NvlinkDomain((Gpu(0, "a6000", 48 * GB), Gpu(2, "a6000", 48 * GB))),))
    with pytest.raises(ClusterError, match="indices"):
        settings_mapping(Cluster((gap,)))


def test_model_rejects_impossible_clusters() -> None:
    gpu = Gpu(0, "a6000", 48 * GB)
    with pytest.raises(ClusterError, match="twice"):
        Node("n", (NvlinkDomain((gpu,)), NvlinkDomain((gpu,))))
    with pytest.raises(ClusterError, match="at least one GPU"):
        NvlinkDomain(())
    node = Node("n", (NvlinkDomain((gpu,)),))
    with pytest.raises(ClusterError, match="twice"):
        Cluster((node, node))
    with pytest.raises(ClusterError, match="does not divide"):
        Cluster.uniform(1, 4, 3, "a6000", 1)
    with pytest.raises(ClusterError, match="no GPU 5"):
        node.gpu(5)
    with pytest.raises(ClusterError, match="no node"):
        Cluster((node,)).node("other")
