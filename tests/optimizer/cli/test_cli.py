"""The ``scepsy`` dispatcher and ``scepsy stats`` output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from optimizer.cli.main import UsageError, main, parse_duration_s
from tests.optimizer.conftest import Row, call


def _rows() -> list[Row]:
    return [
        call("rag", "r1", "embed", 0, 1),
        call("rag", "r1", "gen", 1, 3),
        call("rag", "r2", "embed", 10, 11),
        call("rag", "r2", "gen", 11, 15),
        call("rag", None, "gen", 12, 13),
    ]


def test_stats_json_shape(
    write_store: Callable[[list[Row]], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    store = write_store(_rows())
    assert main(["stats", "--store", str(store), "--window", "all", "--json"]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    rag = doc["workflows"]["rag"]
    assert rag["requests"] == 2
    assert rag["unidentified_calls"] == 1
    assert rag["arrival_rate"] == pytest.approx(0.1)
    gen = rag["models"]["gen"]
    assert {"n", "p", "latency_mean", "share_mean", "share_cv"} <= set(gen)
    assert gen["latency_mean"] == pytest.approx(3.0)
    assert gen["share_mean"] == pytest.approx((2 / 3 + 4 / 5) / 2)


def test_stats_window_is_anchored_at_the_last_call(
    write_store: Callable[[list[Row]], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    store = write_store(_rows())
    assert main(["stats", "--store", str(store), "--window", "8s", "--json"]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    assert doc["workflows"]["rag"]["requests"] == 1  # r1 started 15 s before the last call


def test_stats_table(
    write_store: Callable[[list[Row]], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    store = write_store(_rows())
    assert main(["stats", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert "rag" in out and "embed" in out and "without request id" in out


def test_stats_report_models_that_run_at_once(
    write_store: Callable[[list[Row]], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # a fan-out: gen [0,4] beside ver [1,3] (2 s together), then gen alone
    store = write_store(
        [
            call("fan", "f1", "gen", 0, 4),
            call("fan", "f1", "ver", 1, 3),
            call("fan", "f1", "gen", 5, 6),
            *_rows(),
        ]
    )
    assert main(["stats", "--store", str(store), "--window", "all", "--json"]) == 0
    doc = orjson.loads(capsys.readouterr().out)["workflows"]
    assert doc["fan"]["overlaps"] == [{"models": ["gen", "ver"], "together_s": 2.0}]
    assert doc["rag"]["overlaps"] == []  # embed, then gen
    assert main(["stats", "--store", str(store)]) == 0
    assert "fan: gen and ver run at once 2.000 s per request" in capsys.readouterr().out


def test_bad_window_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--store", str(tmp_path), "--window", "soon"]) == 2
    assert "not a duration" in capsys.readouterr().err


def test_parse_duration() -> None:
    assert parse_duration_s("15m") == 900.0
    assert parse_duration_s("2h") == 7200.0
    assert parse_duration_s("1.5") == 1.5
    with pytest.raises(UsageError):
        parse_duration_s("-3s")


def test_stats_window_never_reaches_back_before_the_first_call(
    write_store: Callable[[list[Row]], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # a 3-minute store, one request a second: a 15-minute window reads 1/s, not 0.2/s
    store = write_store([call("agent", f"r{i}", "m", 1000.0 + i, 1000.5 + i) for i in range(180)])
    assert main(["stats", "--store", str(store), "--window", "15m", "--json"]) == 0
    agent = orjson.loads(capsys.readouterr().out)["workflows"]["agent"]
    assert agent["requests"] == 180
    assert agent["window_s"] == pytest.approx(179.5, abs=0.01)
    assert agent["arrival_rate"] == pytest.approx(180 / 179.5, rel=1e-3)
    # a window shorter than the store still ends at the last call and spans its length
    assert main(["stats", "--store", str(store), "--window", "1m", "--json"]) == 0
    agent = orjson.loads(capsys.readouterr().out)["workflows"]["agent"]
    assert agent["window_s"] == pytest.approx(60.0, abs=0.01)
    assert agent["arrival_rate"] == pytest.approx(1.0, rel=0.02)
