"""This node's GPUs from NVML: types, memory and NVLink domains, rendered as a ``cluster:`` section.

Role: the only code that asks the NVIDIA driver about hardware. ``read_node`` takes the NVML
binding as a parameter (default: the ``pynvml`` module of the ``nvidia-ml-py`` distribution), so
tests hand it a fake module object.

Invariants:
- without an NVIDIA driver (no ``libnvidia-ml``, driver not loaded, or ``nvidia-ml-py`` missing)
  it raises :class:`InventoryError` with one plain sentence, never an NVML traceback;
- NVLink peers are the pairs whose ``nvmlDeviceGetP2PStatus(a, b, NVML_P2P_CAPS_INDEX_NVLINK)``
  is OK (what vLLM uses); a query that fails counts as "no NVLink". Domains are the connected
  components of that relation, so NVSwitch systems come out as one domain and bridged pairs
  as pairs; a GPU with no peer is a domain of its own;
- NVML is shut down again whatever happens after a successful init.
"""

from __future__ import annotations

import importlib
import re
import socket
from typing import Any

import yaml

from shared.cluster import Cluster, Gpu, Node, NvlinkDomain, settings_mapping

__all__ = ["InventoryError", "gpu_type_name", "read_node", "render_settings"]

# Words in NVML product names that say nothing about the GPU model.
_NOISE = frozenset({"nvidia", "geforce", "tesla", "quadro"})
_WORKSTATION_A = re.compile(r"a\d+")  # "RTX A6000": the RTX brand adds nothing to A-series names


class InventoryError(RuntimeError):
    """NVML is unavailable or answered something unusable; the message says which, plainly."""


def gpu_type_name(product: str) -> str:
    """The type name settings and profiles use, one per NVML product name: lower case, the
    brand words dropped, the rest joined by ``-``. The variant words stay, because they change
    the memory bandwidth and size a profile depends on: ``NVIDIA RTX A6000`` → ``a6000``,
    ``NVIDIA H100 80GB HBM3`` (SXM) → ``h100-80gb-hbm3``, ``NVIDIA H100 PCIe`` → ``h100-pcie``,
    ``NVIDIA H100 NVL`` → ``h100-nvl``, ``NVIDIA A100-SXM4-80GB`` → ``a100-sxm4-80gb``,
    ``NVIDIA RTX PRO 6000 Blackwell Server Edition`` →
    ``rtx-pro-6000-blackwell-server-edition``."""
    words = [w for w in re.split(r"[\s\-_/]+", product.lower()) if w and w not in _NOISE]
    if len(words) > 1 and words[0] == "rtx" and _WORKSTATION_A.fullmatch(words[1]):
        words = words[1:]
    return "-".join(words) or "unknown"


def _text(value: Any) -> str:
    # pynvml returns bytes in old releases and str in new ones.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvml_module() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise InventoryError(
            "the nvidia-ml-py package (module pynvml) is not installed, so NVIDIA GPUs cannot "
            "be inventoried: pip install 'scepsy[optimizer]'"
        ) from exc


def _domains(count: int, linked: set[tuple[int, int]]) -> list[list[int]]:
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in linked:
        parent[root(a)] = root(b)
    groups: dict[int, list[int]] = {}
    for i in range(count):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values(), key=min)


def read_node(nvml: Any = None, node_name: str | None = None) -> Node:
    """This machine's GPUs as one :class:`Node` (named ``node_name``, default the host name)."""
    nvml = _nvml_module() if nvml is None else nvml
    error = nvml.NVMLError
    try:
        nvml.nvmlInit()
    except error as exc:
        raise InventoryError(
            f"no NVIDIA driver found on this machine (NVML: {exc}); run this on a GPU node, "
            "or describe the cluster in the settings file instead"
        ) from exc
    try:
        count = int(nvml.nvmlDeviceGetCount())
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        gpus = [
            Gpu(
                i,
                gpu_type_name(_text(nvml.nvmlDeviceGetName(h))),
                int(nvml.nvmlDeviceGetMemoryInfo(h).total),
            )
            for i, h in enumerate(handles)
        ]
        linked: set[tuple[int, int]] = set()
        for a in range(count):
            for b in range(a + 1, count):
                try:
                    status = nvml.nvmlDeviceGetP2PStatus(
                        handles[a], handles[b], nvml.NVML_P2P_CAPS_INDEX_NVLINK
                    )
                except error:
                    continue  # not supported on this pair: no NVLink between them
                if status == nvml.NVML_P2P_STATUS_OK:
                    linked.add((a, b))
    except error as exc:
        raise InventoryError(f"NVML failed while listing GPUs: {exc}") from exc
    finally:
        try:
            nvml.nvmlShutdown()
        except error:
            pass  # nothing to undo; the answer (or the error above) is what matters
    if count == 0:
        raise InventoryError("the NVIDIA driver is loaded but reports no GPUs on this machine")
    domains = tuple(NvlinkDomain(tuple(gpus[i] for i in g)) for g in _domains(count, linked))
    return Node(node_name or socket.gethostname(), domains)


def render_settings(cluster: Cluster) -> str:
    """The cluster as a YAML settings document holding only the ``cluster:`` section."""
    return yaml.safe_dump(
        {"cluster": settings_mapping(cluster)}, sort_keys=False, default_flow_style=None
    )
