"""The segment writer and reader: typed columns, atomic segments, time-range reads."""

from __future__ import annotations

from pathlib import Path

import duckdb

from shared.records import COLUMN_NAMES, CallRecord, scrub_body
from shared.store import SegmentWriter, StoreReader, segment_dir


def _record(i: int, **kw: object) -> CallRecord:
    rec = CallRecord(
        call_id=f"c{i}",
        proxy_id="p1",
        workflow="wf",
        request_id=None,
        model="m",
        endpoint="/v1/chat/completions",
        t_start=1_000 + i,
    )
    for k, v in kw.items():
        setattr(rec, k, v)
    return rec


def test_write_then_read_typed(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path, "p1")
    path = writer.write(
        [_record(i, prompt_tokens=i if i % 2 else None).row() for i in range(10)]
    ).path
    writer.close()
    assert path is not None and path.exists() and path.parent == segment_dir(tmp_path, "p1")
    rel = StoreReader(tmp_path).calls(1_002, 1_005)
    assert rel.columns == list(COLUMN_NAMES)
    rows = rel.order("t_start").fetchall()
    assert [r[0] for r in rows] == ["c2", "c3", "c4"]
    assert [r[COLUMN_NAMES.index("prompt_tokens")] for r in rows] == [None, 3, None]
    types = dict(zip(rel.columns, map(str, rel.types), strict=True))
    assert types["t_start"] == "BIGINT" and types["stream"] == "BOOLEAN"


def test_empty_store_reads_empty_relation(tmp_path: Path) -> None:
    rel = StoreReader(tmp_path).calls()
    assert rel.fetchall() == [] and rel.columns == list(COLUMN_NAMES)


def test_stale_tmp_is_removed_and_never_read(tmp_path: Path) -> None:
    d = segment_dir(tmp_path, "p1")
    d.mkdir(parents=True)
    (d / ".seg-half.parquet.tmp").write_bytes(b"PAR1 garbage")
    assert StoreReader(tmp_path).calls().fetchall() == []
    SegmentWriter(tmp_path, "p1").close()
    assert not list(d.glob(".*"))


def test_scrub_body_redacts_secrets_only() -> None:
    import orjson

    raw = orjson.dumps(
        {
            "model": "m",
            "max_tokens": 4,
            "api_key": "sk-1",
            "metadata": {"Authorization": "Bearer x", "token": "t"},
        }
    )
    out = orjson.loads(scrub_body(raw, orjson.loads(raw)))
    assert out["max_tokens"] == 4 and out["api_key"] == "[redacted]"
    assert out["metadata"] == {"Authorization": "[redacted]", "token": "[redacted]"}
    plain = b'{"model": "m", "max_tokens": 4}'
    assert scrub_body(plain, orjson.loads(plain)) == plain.decode()


def test_segments_use_the_fast_codec_and_older_zstd_ones_still_read(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path, "p1")
    path = writer.write([_record(i).row() for i in range(3)]).path
    writer.close()
    assert path is not None
    con = duckdb.connect()
    codecs = {
        c
        for (c,) in con.execute(
            f"SELECT DISTINCT compression FROM parquet_metadata('{path}')"
        ).fetchall()
    }
    assert codecs == {"LZ4_RAW"}
    old = path.with_name("seg-0000000000000000-old-000000.parquet")
    con.execute(
        f"COPY (SELECT * FROM read_parquet('{path}')) TO '{old}' (FORMAT parquet, COMPRESSION zstd)"
    )
    reader = StoreReader(tmp_path)
    try:
        assert reader.calls().aggregate("count(*)").fetchall() == [(6,)]
    finally:
        reader.close()
