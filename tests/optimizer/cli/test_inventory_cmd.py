"""``scepsy inventory``: table and settings from a fake NVML; a plain error without a driver."""

from __future__ import annotations

import argparse
import importlib
import warnings
from pathlib import Path

import pytest
import yaml

from optimizer.cli.inventory import run
from optimizer.cli.main import main
from shared.cluster import ClusterSettings, cluster_from_settings
from shared.settings_schema import decode
from tests.shared.test_inventory import A6000, FakeNvml, FakeNvmlError, pairs


def four_a6000() -> FakeNvml:
    return FakeNvml([("NVIDIA RTX A6000", A6000)] * 4, pairs((0, 1), (2, 3)))


def test_writes_settings_that_load_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cluster.yaml"
    args = argparse.Namespace(out=out, node_name="gpu-3")
    assert run(args, nvml=four_a6000()) == 0
    printed = capsys.readouterr().out
    assert "a6000" in printed and "gpu-3" in printed and str(out) in printed
    cluster = cluster_from_settings(
        decode(ClusterSettings, yaml.safe_load(out.read_text())["cluster"], "cluster")
    )
    assert [d.indices for d in cluster.node("gpu-3").domains] == [(0, 1), (2, 3)]
    assert cluster.node("gpu-3").gpu(0).memory_bytes == A6000


def test_without_out_prints_the_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(argparse.Namespace(out=None, node_name="n"), nvml=four_a6000()) == 0
    text = capsys.readouterr().out
    section = yaml.safe_load(text[text.index("cluster:") :])["cluster"]
    assert section["nodes"][0]["nvlink_domains"] == [[0, 1], [2, 3]]


def test_no_driver_says_so_on_stderr_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nvml = FakeNvml([], set(), init_error=FakeNvmlError("Driver Not Loaded"))
    out = tmp_path / "cluster.yaml"
    assert run(argparse.Namespace(out=out, node_name=None), nvml=nvml) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("scepsy inventory: no NVIDIA driver found")
    assert "Traceback" not in captured.err
    assert not out.exists()


def test_dispatcher_on_this_machine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        pynvml = importlib.import_module("pynvml")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        assert main(["inventory", "--out", str(tmp_path / "c.yaml")]) == 1
        assert "no NVIDIA driver found" in capsys.readouterr().err
        return
    assert main(["inventory", "--out", str(tmp_path / "c.yaml")]) == 0
    assert (tmp_path / "c.yaml").read_text().startswith("cluster:")
