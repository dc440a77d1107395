"""``scepsy allocate``: the paper scenario end to end (table, JSON, plot), store mode, bad input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from optimizer.cli.main import main
from optimizer.search.scenario import load_scenario
from optimizer.store.profiles import save_points
from shared.settings_schema import SettingsError
from tests.optimizer.conftest import Row, call
from tests.optimizer.search.instances import curve

ROOT = Path(__file__).resolve().parents[3]
PAPER = ROOT / "examples" / "scenario_paper.yaml"


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main(argv) == 0
    doc: dict[str, Any] = orjson.loads(capsys.readouterr().out)
    return doc


def test_paper_scenario_json(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, ["allocate", "--scenario", str(PAPER), "--json"])
    assert doc["feasible"] and doc["welfare"] == "egalitarian" and doc["relaxed"] == ""
    assert set(doc["workflows"]) == {"beam_search", "rag_rerank"}
    rag = doc["workflows"]["rag_rerank"]
    assert rag["throughput"] >= rag["rate"] * 1.1
    # the tiny embedding model is co-located on a GPU fraction (where fractions pay)
    assert rag["models"]["e5-base-v2"]["share"] < 1.0
    total = sum(w["gpus"] for w in doc["workflows"].values())
    assert total <= 8
    placed = doc["placement"]
    replicas = sum(m["replicas"] for w in doc["workflows"].values() for m in w["models"].values())
    assert len(placed) == replicas
    usage: dict[tuple[str, int], float] = {}
    for r in placed:
        for g in r["gpus"]:
            usage[(r["node"], g)] = usage.get((r["node"], g), 0.0) + r["share"]
    assert max(usage.values()) <= 1.0 + 1e-9
    assert doc["search"]["candidates_evaluated"] > 0 and doc["search"]["seconds"] > 0


def test_plan_is_an_alias_that_names_the_new_command(capsys: pytest.CaptureFixture[str]) -> None:
    """Scripts written for ``scepsy plan`` keep working, told the new name on stderr."""
    argv = ["--scenario", str(PAPER), "--json"]
    assert main(["allocate", *argv]) == 0
    new = capsys.readouterr()
    assert main(["plan", *argv]) == 0
    old = capsys.readouterr()
    assert old.err == "scepsy plan is now scepsy allocate\n" and new.err == ""
    drop = ("seconds",)  # the search's own timing differs run to run
    a, b = orjson.loads(old.out), orjson.loads(new.out)
    for doc in (a, b):
        for key in drop:
            doc["search"].pop(key)
    assert a == b


def test_paper_scenario_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "curves.png"
    assert main(["allocate", "--scenario", str(PAPER), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for word in ("beam_search", "e5-base-v2", "placement", "node-0", "predicted", "pruned"):
        assert word in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ablation_flags_and_rate_override(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(
        capsys,
        [
            "allocate",
            "--scenario",
            str(PAPER),
            "--json",
            "--no-fraction",
            "--no-tp",
            "--rate",
            "rag_rerank=2",
        ],
    )
    models = [m for w in doc["workflows"].values() for m in w["models"].values()]
    assert {m["share"] for m in models} == {1.0} and {m["tp"] for m in models} == {1}
    assert doc["workflows"]["rag_rerank"]["rate"] == 2.0


def test_overload_is_reported_infeasible(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["allocate", "--scenario", str(PAPER), "--json", "--rate", "beam_search=50"])
    doc = orjson.loads(capsys.readouterr().out)
    beam = doc["workflows"]["beam_search"]
    assert not doc["feasible"] and not beam["feasible"]
    assert doc["relaxed"] == ""  # not even on point estimates with 2% headroom
    assert 0 < beam["served_rate"] < 50
    # placement may or may not find room for the fractions; the exit status says which
    assert code == (0 if doc["placement"] is not None else 1)
    assert doc["placement_attempts"] == 1 + len(doc["placement_errors"]) or code == 1


def test_bad_scenario_names_the_key(tmp_path: Path) -> None:
    data = yaml.safe_load(PAPER.read_text())
    data["workflows"][1]["stages"][0]["p"] = 0.5
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(SettingsError, match=r"workflows\[1\]\.stages\[0\]\.p"):
        load_scenario(bad)
    data = yaml.safe_load(PAPER.read_text())
    data["workflows"][0]["stages"][0]["model"] = "unprofiled"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(SettingsError, match=r"workflows\[0\]\.stages\[0\]\.model"):
        load_scenario(bad)


def test_scenario_overlaps_reach_the_pipeline_and_are_checked(tmp_path: Path) -> None:
    data = yaml.safe_load(PAPER.read_text())
    beam = data["workflows"][0]
    beam["overlaps"] = [{"a": "llama-3.2-1b", "b": "llama-3.1-8b-prm", "coupling": 1.5}]
    path = tmp_path / "fan.yaml"
    path.write_text(yaml.safe_dump(data))
    pipe = load_scenario(path)[0].workflows[0].pipeline()
    assert [(o.a, o.b, o.coupling) for o in pipe.overlaps] == [
        ("llama-3.2-1b", "llama-3.1-8b-prm", 1.5)
    ]
    for key, value, where in (
        ("b", "e5-base-v2", r"overlaps\[0\]\.b"),
        ("coupling", 3.0, r"overlaps\[0\]\.coupling"),
        ("b", "llama-3.2-1b", r"overlaps\[0\]\.b"),
    ):
        beam["overlaps"] = [{"a": "llama-3.2-1b", "b": "llama-3.1-8b-prm", key: value}]
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(SettingsError, match=r"workflows\[0\]\." + where):
            load_scenario(path)


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["allocate", "--scenario", str(PAPER), "--rate", "nope=1"]) == 2
    assert main(["allocate", "--scenario", str(PAPER), "--rate", "rag_rerank"]) == 2
    assert main(["allocate", "--scenario", str(tmp_path / "missing.yaml")]) == 2
    assert main(["allocate", "--store", str(tmp_path)]) == 2  # --config missing
    err = capsys.readouterr().err
    assert "unknown workflow" in err and "--config" in err


def test_store_mode(
    write_store: Callable[[list[Row]], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = []
    for i in range(40):  # one request every 0.5 s: 2 calls to gen (in parallel), 1 to ver
        t = i * 0.5
        rows += [
            call("agent", f"r{i}", "gen", t, t + 0.2),
            call("agent", f"r{i}", "gen", t, t + 0.2),
            call("agent", f"r{i}", "ver", t + 0.2, t + 0.3),
        ]
    store = write_store(rows)
    save_points(store, curve("gen", 1, 20.0, 0.2, 1.0) + curve("ver", 1, 30.0, 0.1, 1.0))
    config = tmp_path / "scepsy.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "cluster": {"node_count": 1, "gpus_per_node": 2, "gpu_type": "a6000"},
                "rollout": {
                    "models": [
                        {"name": "gen", "min_memory_gb": 10},
                        {"name": "ver", "min_memory_gb": 10},
                    ]
                },
            }
        )
    )
    doc = _json(capsys, ["allocate", "--store", str(store), "--config", str(config), "--json"])
    agent = doc["workflows"]["agent"]
    assert agent["rate"] == pytest.approx(2.0, rel=0.1)
    assert agent["feasible"] and set(agent["models"]) == {"gen", "ver"}
    for m in agent["models"].values():
        assert m["share"] * m["tp"] * 48 >= 10 - 1e-9
