"""The store's defences against one bad row and a killed writer: storable rows, quarantine, and
the journal's replay (real files, real DuckDB, a real killed process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.journal import Journal, encode, journal_dir, replay
from shared.records import COLUMN_NAMES, COLUMNS, MAX_TEXT, CallRecord, storable
from shared.store import SegmentWriter, StoreReader

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000_000_000


def _row(i: int, **changes: Any) -> tuple[Any, ...]:
    rec = CallRecord(
        f"c{i}",
        "p1",
        "wf",
        f"r{i}",
        "m",
        "/v1/chat/completions",
        t_start=T0 + i,
        t_end=T0 + i + 10,
        status=200,
    )
    for key, value in changes.items():
        setattr(rec, key, value)
    return rec.row()


def _stored(store: Path) -> list[tuple[Any, ...]]:
    reader = StoreReader(store)
    try:
        return reader.calls().order("call_id").fetchall()
    finally:
        reader.close()


anything = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(), st.binary(max_size=8)
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(values=st.lists(anything, min_size=len(COLUMNS), max_size=len(COLUMNS)))
def test_any_row_made_storable_is_written_and_read_back(tmp_path: Path, values: list[Any]) -> None:
    row = storable(values)
    for (_, sql), v in zip(COLUMNS, row, strict=True):
        if v is None:
            continue
        if sql == "VARCHAR":
            assert isinstance(v, str) and len(v.encode()) >= 0 and len(v) <= 64 * 2**20
        elif sql in ("BIGINT", "INTEGER"):
            assert type(v) is int and -(2**63) <= v < 2**63
        else:
            assert type(v) is bool
    encode(row)  # the journal takes it too
    store = tmp_path / f"s{abs(hash(repr(values)))}"
    writer = SegmentWriter(store, "p1")
    try:
        written = writer.write([row])
    finally:
        writer.close()
    assert written.rows == 1 and not written.quarantined


def test_the_values_that_once_lost_a_batch_now_cost_nothing(tmp_path: Path) -> None:
    # A 64-bit retry count, tokens past 32 bits, undecodable bytes in identity values: each
    # once made DuckDB refuse the whole flush batch around it.
    rows = [_row(i) for i in range(20)]
    rows[3] = _row(3, attempt=99_999_999_999)
    rows[7] = _row(7, prompt_tokens=2**40, completion_tokens=2**70)
    rows[11] = _row(11, workflow="w\udcff", request_id="r\ud800x", error="e" * (MAX_TEXT + 9))
    writer = SegmentWriter(tmp_path, "p1")
    try:
        written = writer.write(rows)
    finally:
        writer.close()
    assert written.rows == 20 and not written.quarantined
    stored = {r[0]: dict(zip(COLUMN_NAMES, r, strict=True)) for r in _stored(tmp_path)}
    assert len(stored) == 20
    assert stored["c3"]["attempt"] == 99_999_999_999
    assert stored["c7"]["prompt_tokens"] == 2**40 and stored["c7"]["completion_tokens"] is None
    assert stored["c11"]["workflow"] == "w\ufffd" and stored["c11"]["request_id"] == "r?x"
    assert len(stored["c11"]["error"]) == MAX_TEXT


def test_a_row_duckdb_refuses_is_quarantined_and_its_neighbours_written(tmp_path: Path) -> None:
    rows = [_row(i) for i in range(9)]
    rows[4] = _row(4, status="not a status")  # past storable: what a future bug could hand it
    writer = SegmentWriter(tmp_path, "p1")
    try:
        written = writer._write_checked(rows)
    finally:
        writer.close()
    assert written.rows == 8 and sum(written.quarantined.values()) == 1
    assert [r[0] for r in _stored(tmp_path)] == [f"c{i}" for i in range(9) if i != 4]
    (kept,) = list((tmp_path / "quarantine" / "proxy=p1").glob("*.jsonl"))
    doc = orjson.loads(kept.read_bytes())
    assert doc["row"]["call_id"] == "c4" and "Conversion" in doc["reason"]


def test_a_journal_whose_rows_are_written_leaves_nothing_behind(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    for i in range(5):
        journal.append(_row(i))
    journal.rotate()
    journal.append(_row(5))
    journal.resolved(5)
    assert len(list(journal.directory.glob("*.jsonl"))) == 1  # the current generation
    journal.resolved(1)
    journal.close(written=True)
    assert list(journal.directory.iterdir()) == []


def test_a_living_journal_is_never_replayed(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.append(_row(1))
    journal.sync()
    try:
        assert replay(tmp_path, lambda rows: pytest.fail("replayed a live journal")) == (0, 0)
    finally:
        journal.close(written=False)


_KILLED = textwrap.dedent("""
    import os, sys
    from shared.journal import Journal
    from shared.store import SegmentWriter
    from shared.records import CallRecord
    store = sys.argv[1]
    journal, writer = Journal(store), SegmentWriter(store, "p1")
    rows = [CallRecord(f"c{i}", "p1", "wf\\udcff", None, "m", "/v1/completions", t_start=i,
                       t_end=i + 1, status=200).row() for i in range(30)]
    for row in rows[:10]:
        journal.append(row)
    journal.rotate()
    writer.write(rows[:10])  # flushed, but killed before its generation was deleted
    for row in rows[10:]:
        journal.append(row)
    journal.sync()
    os.write(journal._fd, b'["c99", "p1", "cut sho')  # a line the kill cut short
    print("ready", flush=True)
    sys.stdin.read()
""")


@pytest.mark.timeout(60)
def test_rows_of_a_killed_recorder_are_replayed_once(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, str(tmp_path)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        assert replay(tmp_path, lambda rows: pytest.fail("replayed a live journal")) == (0, 0)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    writer = SegmentWriter(tmp_path, "restarted")
    try:
        assert replay(tmp_path, writer.write) == (20, 1)
    finally:
        writer.close()
    ids = [r[0] for r in _stored(tmp_path)]
    assert sorted(ids) == sorted(f"c{i}" for i in range(30))  # each once
    assert list(journal_dir(tmp_path).iterdir()) == []
    assert os.listdir(tmp_path / "calls")  # the replayed rows landed in segments
