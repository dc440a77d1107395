"""NVML inventory: a fake NVML module for the happy path, and the no-driver paths."""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from shared.cluster import Cluster, ClusterSettings, cluster_from_settings
from shared.inventory import InventoryError, gpu_type_name, read_node, render_settings
from shared.settings_schema import decode


class FakeNvmlError(Exception):
    pass


@dataclass
class _Memory:
    total: int


class FakeNvml:
    """The slice of pynvml that inventory uses, over a list of (name, memory) and NVLink pairs."""

    NVMLError = FakeNvmlError
    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0
    NVML_P2P_STATUS_NOT_SUPPORTED = 5

    def __init__(
        self,
        gpus: list[tuple[Any, int]],
        nvlink: set[frozenset[int]],
        *,
        init_error: Exception | None = None,
        broken_pairs: set[frozenset[int]] | None = None,
        fail_listing: bool = False,
    ) -> None:
        self.gpus = gpus
        self.nvlink = nvlink
        self.init_error = init_error
        self.broken_pairs = broken_pairs or set()
        self.fail_listing = fail_listing
        self.initialised = False
        self.shutdowns = 0
        self.p2p_queries: list[tuple[int, int, int]] = []

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        if self.fail_listing:
            raise FakeNvmlError("GPU is lost")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        assert self.initialised
        return 100 + i

    def nvmlDeviceGetName(self, handle: int) -> Any:
        return self.gpus[handle - 100][0]

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> _Memory:
        return _Memory(self.gpus[handle - 100][1])

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        self.p2p_queries.append((a - 100, b - 100, index))
        pair = frozenset((a - 100, b - 100))
        if pair in self.broken_pairs:
            raise FakeNvmlError("Not Supported")
        ok = index == self.NVML_P2P_CAPS_INDEX_NVLINK and pair in self.nvlink
        return self.NVML_P2P_STATUS_OK if ok else self.NVML_P2P_STATUS_NOT_SUPPORTED


A6000 = 51_527_024_640


def pairs(*groups: tuple[int, int]) -> set[frozenset[int]]:
    return {frozenset(g) for g in groups}


def test_a6000_node_with_nvlink_pairs() -> None:
    nvml = FakeNvml([("NVIDIA RTX A6000", A6000)] * 4, pairs((0, 1), (2, 3)))
    node = read_node(nvml, node_name="gpu-1")
    assert node.name == "gpu-1"
    assert [d.indices for d in node.domains] == [(0, 1), (2, 3)]
    assert {g.type for g in node.gpus} == {"a6000"}
    assert node.gpu(2).memory_bytes == A6000
    assert nvml.shutdowns == 1
    assert all(q[2] == FakeNvml.NVML_P2P_CAPS_INDEX_NVLINK for q in nvml.p2p_queries)


def test_domains_are_connected_components_and_unlinked_gpus_stand_alone() -> None:
    # An NVSwitch-like chain 0-1, 1-2, 2-4 is one domain; GPU 3 has no peer; a failing query
    # (0, 3) counts as no NVLink. Names may come as bytes from old pynvml releases.
    nvml = FakeNvml(
        [(b"NVIDIA H100 80GB HBM3", 80 * 10**9)] * 5,
        pairs((0, 1), (1, 2), (2, 4)),
        broken_pairs=pairs((0, 3)),
    )
    node = read_node(nvml, node_name="h")
    assert [d.indices for d in node.domains] == [(0, 1, 2, 4), (3,)]
    assert node.gpus[0].type == "h100-80gb-hbm3"


def test_rendered_settings_decode_back_to_the_same_cluster() -> None:
    nvml = FakeNvml([("NVIDIA RTX A6000", A6000)] * 4, pairs((0, 1), (2, 3)))
    cluster = Cluster((read_node(nvml, node_name="gpu-1"),))
    text = render_settings(cluster)
    assert text.startswith("cluster:")
    section = decode(ClusterSettings, yaml.safe_load(text)["cluster"], "cluster")
    assert cluster_from_settings(section) == cluster


@pytest.mark.parametrize(
    ("product", "short"),
    [
        ("NVIDIA RTX A6000", "a6000"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
        ("NVIDIA H200", "h200"),
        ("Tesla V100-SXM2-16GB", "v100-sxm2-16gb"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000-blackwell-server-edition"),
    ],
)
def test_gpu_type_names(product: str, short: str) -> None:
    assert gpu_type_name(product) == short


@given(st.text(max_size=60))
def test_gpu_type_names_are_settings_safe_and_keep_distinct_variants(product: str) -> None:
    # Any NVML answer gives a name usable as a settings value and a profile key: one line,
    # no spaces; and two products that differ in a variant word never share a name.
    name = gpu_type_name(product)
    assert name and name == name.strip() and not any(c.isspace() for c in name)
    assert gpu_type_name(product + " PCIe") != gpu_type_name(product + " SXM5")


def test_no_driver_is_a_plain_error() -> None:
    nvml = FakeNvml([], set(), init_error=FakeNvmlError("NVML Shared Library Not Found"))
    with pytest.raises(InventoryError, match="no NVIDIA driver found") as info:
        read_node(nvml)
    assert "Shared Library Not Found" in str(info.value)
    assert nvml.shutdowns == 0


def _pynvml() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return importlib.import_module("pynvml")


def test_real_pynvml_error_class_without_driver() -> None:
    pynvml = _pynvml()
    error = pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    nvml = FakeNvml([], set(), init_error=error)
    nvml.NVMLError = pynvml.NVMLError
    with pytest.raises(InventoryError, match="no NVIDIA driver found"):
        read_node(nvml)


def test_this_machine_without_a_driver() -> None:
    pynvml = _pynvml()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        with pytest.raises(InventoryError, match="no NVIDIA driver found"):
            read_node()
        return
    pynvml.nvmlShutdown()
    pytest.skip("this machine has an NVIDIA driver; the no-driver path needs one without")


def test_driver_without_gpus_and_failures_while_listing() -> None:
    empty = FakeNvml([], set())
    with pytest.raises(InventoryError, match="reports no GPUs"):
        read_node(empty)
    assert empty.shutdowns == 1
    lost = FakeNvml([("NVIDIA H200", 1)], set(), fail_listing=True)
    with pytest.raises(InventoryError, match="GPU is lost"):
        read_node(lost)
    assert lost.shutdowns == 1


def test_missing_pynvml_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def no_pynvml(name: str, package: str | None = None) -> Any:
        if name == "pynvml":
            raise ModuleNotFoundError("No module named 'pynvml'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_pynvml)
    with pytest.raises(InventoryError, match=r"nvidia-ml-py package .* is not installed"):
        read_node()
