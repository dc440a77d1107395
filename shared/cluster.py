"""The cluster model: nodes → NVLink domains → GPUs, and the ``cluster:`` settings section.

Role: the one description of the hardware that the optimizer's search and placement, the
rollout backends and the simulator agree on. It comes from the settings file (this module), from
NVML on a node (:mod:`shared.inventory`), or later from node labels.

Invariants:
- every value is frozen; a :class:`Cluster` is built once and shared freely;
- inside a node GPU indices are unique and every GPU belongs to exactly one NVLink domain (a GPU
  without NVLink peers is a domain of its own); node names are unique in a cluster;
- GPU indices are NVML's (PCI bus order), so a rollout sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
  before it uses them in ``CUDA_VISIBLE_DEVICES``;
- memory in settings is decimal GB (10^9 bytes, as GPU vendors and ``reference/calibration.md``
  quote it); in the model it is bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from shared.settings_schema import SettingsError, setting

__all__ = [
    "KNOWN_GPU_MEMORY_GB",
    "Cluster",
    "ClusterError",
    "ClusterSettings",
    "Gpu",
    "Node",
    "NodeSettings",
    "NvlinkDomain",
    "cluster_from_settings",
    "settings_mapping",
]

GB = 1_000_000_000

# Total memory of the GPU types the calibration knows (decimal GB), so a settings file may name
# the type alone. Any other type must say its gpu_memory_gb.
KNOWN_GPU_MEMORY_GB: Mapping[str, float] = MappingProxyType(
    {"a6000": 48.0, "a100": 80.0, "h100": 80.0, "h200": 141.0}
)


class ClusterError(ValueError):
    """A cluster that cannot exist (duplicate GPU index, empty domain), or none configured."""


@dataclass(frozen=True)
class Gpu:
    """One GPU: its NVML index on its node, its type (``a6000``, ``h100``...) and total memory."""

    index: int
    type: str
    memory_bytes: int


@dataclass(frozen=True)
class NvlinkDomain:
    """GPUs that reach each other over NVLink; a tensor-parallel group stays inside one."""

    gpus: tuple[Gpu, ...]

    def __post_init__(self) -> None:
        if not self.gpus:
            raise ClusterError("an NVLink domain needs at least one GPU")

    @property
    def size(self) -> int:
        return len(self.gpus)

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)


@dataclass(frozen=True)
class Node:
    """One machine: its name (the Kubernetes node name or host name) and its NVLink domains."""

    name: str
    domains: tuple[NvlinkDomain, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise ClusterError("a node needs a name")
        seen: set[int] = set()
        for domain in self.domains:
            for gpu in domain.gpus:
                if gpu.index in seen:
                    raise ClusterError(f"node {self.name}: GPU {gpu.index} is listed twice")
                seen.add(gpu.index)

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        """All GPUs of the node, by index."""
        return tuple(sorted((g for d in self.domains for g in d.gpus), key=lambda g: g.index))

    def gpu(self, index: int) -> Gpu:
        for domain in self.domains:
            for gpu in domain.gpus:
                if gpu.index == index:
                    return gpu
        raise ClusterError(f"node {self.name} has no GPU {index}")

    def domain_of(self, index: int) -> NvlinkDomain:
        for domain in self.domains:
            if index in domain.indices:
                return domain
        raise ClusterError(f"node {self.name} has no GPU {index}")

    @property
    def max_domain_size(self) -> int:
        return max((d.size for d in self.domains), default=0)


@dataclass(frozen=True)
class Cluster:
    """The whole cluster; node order is the order placement breaks ties in."""

    nodes: tuple[Node, ...]

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ClusterError(f"node {dup[0]} is listed twice")

    @classmethod
    def uniform(
        cls,
        node_count: int,
        gpus_per_node: int,
        domain_size: int,
        gpu_type: str,
        memory_bytes: int,
        name_prefix: str = "node-",
    ) -> Cluster:
        """``node_count`` identical nodes, each split into NVLink domains of ``domain_size``."""
        if node_count < 0 or gpus_per_node < 1 or domain_size < 1:
            raise ClusterError("node_count >= 0, gpus_per_node >= 1 and domain_size >= 1")
        if gpus_per_node % domain_size:
            raise ClusterError(f"domain size {domain_size} does not divide {gpus_per_node} GPUs")
        return cls(
            tuple(
                Node(
                    f"{name_prefix}{n}",
                    tuple(
                        NvlinkDomain(
                            tuple(
                                Gpu(i, gpu_type, memory_bytes)
                                for i in range(start, start + domain_size)
                            )
                        )
                        for start in range(0, gpus_per_node, domain_size)
                    ),
                )
                for n in range(node_count)
            )
        )

    def all_gpus(self) -> tuple[tuple[str, Gpu], ...]:
        """(node name, GPU) for every GPU, in node order then index order."""
        return tuple((node.name, gpu) for node in self.nodes for gpu in node.gpus)

    @property
    def gpu_count(self) -> int:
        return sum(len(node.gpus) for node in self.nodes)

    @property
    def max_domain_size(self) -> int:
        """The largest tensor-parallel degree the cluster can host without crossing NVLink."""
        return max((node.max_domain_size for node in self.nodes), default=0)

    def domain_sizes(self) -> tuple[int, ...]:
        """The size of every NVLink domain, largest first."""
        return tuple(sorted((d.size for n in self.nodes for d in n.domains), reverse=True))

    @property
    def gpu_types(self) -> tuple[str, ...]:
        return tuple(sorted({gpu.type for _, gpu in self.all_gpus()}))

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ClusterError(f"no node named {name!r}")


# --- settings ------------------------------------------------------------------------------


def _memory_gb(gpu_type: str, memory_gb: float | None, key: str) -> float:
    if memory_gb is not None:
        if memory_gb <= 0:
            raise SettingsError(key, "must be positive")
        return memory_gb
    if gpu_type not in KNOWN_GPU_MEMORY_GB:
        known = ", ".join(KNOWN_GPU_MEMORY_GB)
        raise SettingsError(key, f"required for GPU type {gpu_type!r} (known types: {known})")
    return KNOWN_GPU_MEMORY_GB[gpu_type]


@dataclass(frozen=True)
class NodeSettings:
    """One node of an explicitly listed cluster."""

    name: str = setting(doc="node name (the Kubernetes node name, or the host name)")
    gpu_type: str = setting(doc="GPU type, e.g. a6000, a100, h100, h200 (profiles are per type)")
    gpus: int = setting(doc="number of GPUs; their indices are 0..gpus-1 (NVML order)")
    gpu_memory_gb: float | None = setting(
        None, doc="memory per GPU in GB (10^9 bytes); default: known from gpu_type"
    )
    nvlink_domains: tuple[tuple[int, ...], ...] = setting(
        factory=tuple,
        doc="groups of GPU indices joined by NVLink, e.g. [[0, 1], [2, 3]]; a GPU in no group "
        "is a domain of its own",
    )

    def __post_init__(self) -> None:
        if not self.name:
            raise SettingsError("name", "must not be empty")
        if not self.gpu_type:
            raise SettingsError("gpu_type", "must not be empty")
        if self.gpus < 1:
            raise SettingsError("gpus", "must be at least 1")
        _memory_gb(self.gpu_type, self.gpu_memory_gb, "gpu_memory_gb")
        seen: set[int] = set()
        for d, domain in enumerate(self.nvlink_domains):
            if not domain:
                raise SettingsError(f"nvlink_domains[{d}]", "must not be empty")
            for g, index in enumerate(domain):
                key = f"nvlink_domains[{d}][{g}]"
                if not 0 <= index < self.gpus:
                    raise SettingsError(key, f"GPU {index} is not in 0..{self.gpus - 1}")
                if index in seen:
                    raise SettingsError(key, f"GPU {index} is already in another domain")
                seen.add(index)

    def to_node(self) -> Node:
        memory = round(_memory_gb(self.gpu_type, self.gpu_memory_gb, "gpu_memory_gb") * GB)
        listed = {i for domain in self.nvlink_domains for i in domain}
        groups = [*self.nvlink_domains, *((i,) for i in range(self.gpus) if i not in listed)]
        return Node(
            self.name,
            tuple(
                NvlinkDomain(tuple(Gpu(i, self.gpu_type, memory) for i in sorted(group)))
                for group in sorted(groups, key=min)
            ),
        )


@dataclass(frozen=True)
class ClusterSettings:
    """The GPU cluster: either ``nodes`` listed one by one, or the compact uniform form."""

    nodes: tuple[NodeSettings, ...] = setting(
        factory=tuple, doc="the nodes one by one (`scepsy inventory --out` writes this form)"
    )
    node_count: int | None = setting(
        None, doc="compact form: this many identical nodes named node-0, node-1, ..."
    )
    gpus_per_node: int | None = setting(None, doc="compact form: GPUs per node")
    nvlink_domain_size: int = setting(
        1, doc="compact form: GPUs per NVLink domain (1: no NVLink, so no tensor parallelism)"
    )
    gpu_type: str | None = setting(None, doc="compact form: GPU type, e.g. a6000")
    gpu_memory_gb: float | None = setting(
        None, doc="compact form: memory per GPU in GB; default: known from gpu_type"
    )

    def __post_init__(self) -> None:
        compact = self.node_count is not None
        if self.nodes and compact:
            raise SettingsError("node_count", "give either nodes or the compact form, not both")
        if not compact:
            for key in ("gpus_per_node", "gpu_type", "gpu_memory_gb"):
                if getattr(self, key) is not None:
                    raise SettingsError(key, "belongs to the compact form: set node_count too")
            if self.nvlink_domain_size != 1:
                raise SettingsError(
                    "nvlink_domain_size", "belongs to the compact form: set node_count too"
                )
            names = [n.name for n in self.nodes]
            for i, name in enumerate(names):
                if name in names[:i]:
                    raise SettingsError(f"nodes[{i}].name", f"node {name!r} is listed twice")
            return
        assert self.node_count is not None
        if self.node_count < 1:
            raise SettingsError("node_count", "must be at least 1")
        if self.gpus_per_node is None or self.gpus_per_node < 1:
            raise SettingsError("gpus_per_node", "must be at least 1 in the compact form")
        if self.gpu_type is None or not self.gpu_type:
            raise SettingsError("gpu_type", "required in the compact form")
        if self.nvlink_domain_size < 1 or self.gpus_per_node % self.nvlink_domain_size:
            raise SettingsError(
                "nvlink_domain_size",
                f"must divide gpus_per_node ({self.gpus_per_node}), got {self.nvlink_domain_size}",
            )
        _memory_gb(self.gpu_type, self.gpu_memory_gb, "gpu_memory_gb")

    @property
    def configured(self) -> bool:
        return bool(self.nodes) or self.node_count is not None


def cluster_from_settings(settings: ClusterSettings) -> Cluster:
    """The :class:`Cluster` a validated settings section describes."""
    if not settings.configured:
        raise ClusterError(
            "no cluster configured: set cluster.nodes or cluster.node_count in the settings "
            "file, or write it from this node with `scepsy inventory --out FILE`"
        )
    if settings.node_count is None:
        return Cluster(tuple(node.to_node() for node in settings.nodes))
    assert settings.gpus_per_node is not None and settings.gpu_type is not None
    memory = _memory_gb(settings.gpu_type, settings.gpu_memory_gb, "gpu_memory_gb")
    return Cluster.uniform(
        settings.node_count,
        settings.gpus_per_node,
        settings.nvlink_domain_size,
        settings.gpu_type,
        round(memory * GB),
    )


def settings_mapping(cluster: Cluster) -> dict[str, object]:
    """The ``cluster:`` section (explicit form) as plain data for YAML; decodes back to ``cluster``.

    Settings carry one GPU type and one memory size per node, so a node whose GPUs differ in
    either cannot be written and raises :class:`ClusterError`.
    """
    nodes: list[dict[str, object]] = []
    for node in cluster.nodes:
        gpus = node.gpus
        kinds = {(g.type, g.memory_bytes) for g in gpus}
        if len(kinds) != 1:
            raise ClusterError(f"node {node.name}: GPUs of different types or memory sizes")
        if [g.index for g in gpus] != list(range(len(gpus))):
            raise ClusterError(f"node {node.name}: GPU indices are not 0..{len(gpus) - 1}")
        ((gpu_type, memory),) = kinds
        nodes.append(
            {
                "name": node.name,
                "gpu_type": gpu_type,
                "gpus": len(gpus),
                "gpu_memory_gb": memory / GB,
                "nvlink_domains": [list(d.indices) for d in node.domains if d.size > 1],
            }
        )
    return {"nodes": nodes}
