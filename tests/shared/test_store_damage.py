"""A store with a bad file stays readable: truncated, garbage and corrupt-data segments are
skipped with a warning naming each, remembered (path, size, mtime) and counted; real segments
written by the real writer, real DuckDB."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from shared.records import CallRecord
from shared.store import SegmentWriter, StoreReader, segment_dir, unreadable_segments


def _segments(store: Path, count: int, rows: int = 200) -> list[Path]:
    writer = SegmentWriter(store, "p1")
    try:
        paths = []
        for s in range(count):
            batch = [
                CallRecord(
                    call_id=f"c{s}-{i}",
                    proxy_id="p1",
                    workflow="wf",
                    request_id=f"r{s}-{i}",
                    model="m",
                    endpoint="/v1/chat/completions",
                    t_start=1_000_000 * s + i,
                    t_end=1_000_000 * s + i + 500,
                ).row()
                for i in range(rows)
            ]
            path = writer.write(batch).path
            assert path is not None
            paths.append(path)
        return paths
    finally:
        writer.close()


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_data_pages(path: Path) -> None:
    """Scramble every byte between the leading magic and the footer: metadata intact, data not."""
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little") + 8
    for k in range(4, len(data) - footer):
        data[k] = (data[k] * 7 + 13) % 256
    path.write_bytes(bytes(data))


def _count(reader: StoreReader) -> int:
    # call_id's pages are read: a count alone may be answered from the footers' statistics
    rows = reader.read(
        lambda calls: calls.aggregate("count(*) FILTER (WHERE length(call_id) > 0)").fetchall()
    )
    return int(rows[0][0])


@pytest.mark.timeout(30)
def test_truncated_and_garbage_segments_are_skipped_named_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = _segments(tmp_path, 3)
    _truncate(paths[1])
    garbage = segment_dir(tmp_path, "p1") / "seg-garbage.parquet"
    garbage.write_bytes(os.urandom(4096))
    with caplog.at_level(logging.WARNING, logger="shared.store"):
        reader = StoreReader(tmp_path)
        assert _count(reader) == 400
        assert set(reader.skipped) == {paths[1], garbage}
        reader.close()
    warned = [r.getMessage() for r in caplog.records]
    assert any(str(paths[1]) in m and "unreadable" in m for m in warned)
    assert any(str(garbage) in m for m in warned)
    assert set(unreadable_segments(tmp_path)) == {paths[1], garbage}

    # Remembered: the next reader skips them at once, without a second warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shared.store"):
        again = StoreReader(tmp_path)
        assert _count(again) == 400 and set(again.skipped) == {paths[1], garbage}
        again.close()
    assert caplog.records == []


@pytest.mark.timeout(30)
def test_a_segment_with_corrupt_data_pages_is_found_while_the_query_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = _segments(tmp_path, 3)
    _corrupt_data_pages(paths[2])
    with caplog.at_level(logging.WARNING, logger="shared.store"):
        reader = StoreReader(tmp_path)
        assert _count(reader) == 400
        reader.close()
    assert any(str(paths[2]) in r.getMessage() for r in caplog.records)
    assert list(unreadable_segments(tmp_path)) == [paths[2]]


@pytest.mark.timeout(30)
def test_a_replaced_segment_is_read_again_and_a_removed_one_forgotten(tmp_path: Path) -> None:
    paths = _segments(tmp_path, 2)
    good = paths[1].read_bytes()
    _truncate(paths[1])
    assert _count(StoreReader(tmp_path)) == 200
    assert list(unreadable_segments(tmp_path)) == [paths[1]]
    paths[1].write_bytes(good)  # repaired: size and mtime change
    assert _count(StoreReader(tmp_path)) == 400
    assert unreadable_segments(tmp_path) == {}
    _truncate(paths[0])
    assert _count(StoreReader(tmp_path)) == 200
    paths[0].unlink()
    assert unreadable_segments(tmp_path) == {}


@pytest.mark.timeout(30)
def test_a_store_of_bad_segments_only_reads_as_empty(tmp_path: Path) -> None:
    (paths,) = (_segments(tmp_path, 1),)
    _truncate(paths[0])
    reader = StoreReader(tmp_path)
    rel = reader.calls()
    assert rel.fetchall() == [] and reader.skipped == (paths[0],)
    reader.close()


@pytest.mark.timeout(30)
def test_a_healthy_store_reads_through_the_glob(tmp_path: Path) -> None:
    _segments(tmp_path, 2)
    reader = StoreReader(tmp_path)
    assert _count(reader) == 400 and reader.skipped == ()
    assert reader.glob in reader.calls().sql_query()  # one glob, no file list
    reader.close()
