"""The profile table written before points had provenance: read as replay, migrated on write."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import duckdb

from optimizer.store.profiles import db_path, load_points, save_points
from shared.profile_points import ProfilePoint

_OLD_COLUMNS = (
    "model VARCHAR, engine VARCHAR, gpu_type VARCHAR, tp INTEGER, share DOUBLE, "
    "offered_rate DOUBLE, throughput DOUBLE, lat_mean DOUBLE, lat_p50 DOUBLE, lat_p90 DOUBLE, "
    "lat_p99 DOUBLE, ttft_mean DOUBLE, n_calls BIGINT"
)


def _old_table(store: Path) -> None:
    con = duckdb.connect(str(db_path(store)))
    try:
        con.execute(f"CREATE TABLE profile ({_OLD_COLUMNS})")
        con.execute(
            "INSERT INTO profile VALUES ('m', 'e', 'a6000', 1, 1.0, 2, 2, 0.5, 0.5, 0.6, 0.7, "
            "0.1, 100)"
        )
    finally:
        con.close()


def test_an_old_table_reads_as_replay_points_and_is_migrated_on_write(tmp_path: Path) -> None:
    _old_table(tmp_path)
    (old,) = load_points(tmp_path)
    assert (old.source, old.observed_at, old.lat_mean, old.colocation) == ("replay", 0.0, 0.5, "")
    assert old.completion_tokens < 0  # not recorded
    fresh = ProfilePoint(
        "m", "e", "a6000", 1, 0.5, 3, 3, 0.4, 0.4, 0.5, 0.6, 0.1, 40, completion_tokens=12.5
    )
    live = replace(fresh, source="live", observed_at=123.0)
    save_points(tmp_path, [live])
    got = load_points(tmp_path)
    assert got == [live, old]  # by key: share 0.5 first
    # a key measured alone and packed keeps both ends
    ends = [replace(fresh, colocation="alone"), replace(fresh, lat_mean=0.7, colocation="packed")]
    save_points(tmp_path, ends)
    assert sorted(p.colocation for p in load_points(tmp_path) if p.source == "replay") == [
        "",
        "alone",
        "packed",
    ]
    con = duckdb.connect(str(db_path(tmp_path)), read_only=True)
    try:
        cols = {r[1] for r in con.execute("PRAGMA table_info('profile')").fetchall()}
    finally:
        con.close()
    assert {"source", "observed_at", "colocation", "completion_tokens"} <= cols


def test_packed_and_alone_replay_points_replace_only_their_own_arrangement(
    tmp_path: Path,
) -> None:
    base = ProfilePoint("m", "e", "a6000", 1, 0.5, 3, 3, 0.4, 0.4, 0.5, 0.6, 0.1, 40)
    alone = [replace(base, colocation="alone"), replace(base, offered_rate=6, colocation="alone")]
    save_points(tmp_path, alone)
    packed = [replace(base, lat_mean=0.9, colocation="packed")]
    save_points(tmp_path, packed)  # the daemon profiles the copies side by side later
    assert sorted(p.colocation for p in load_points(tmp_path)) == ["alone", "alone", "packed"]
    again = [replace(base, lat_mean=1.1, colocation="packed")]
    save_points(tmp_path, again)  # a new packed run replaces the packed points only
    got = load_points(tmp_path)
    assert [p.lat_mean for p in got if p.colocation == "packed"] == [1.1]
    assert len([p for p in got if p.colocation == "alone"]) == 2
    save_points(tmp_path, [replace(base, lat_mean=0.3, colocation="alone")])
    assert sorted((p.colocation, p.lat_mean) for p in load_points(tmp_path)) == [
        ("alone", 0.3),
        ("packed", 1.1),
    ]
