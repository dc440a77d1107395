"""optimizer.stats.scan: the DuckDB pass leaves the caller's connection as it found it, and
hands back the shifted layout its docstring promises."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from optimizer.stats.reader import summarise
from optimizer.stats.scan import Bounds, scan
from shared.store import StoreReader
from tests.optimizer.conftest import Row, S, call

Write = Callable[[list[Row]], Path]


def _rows() -> list[Row]:
    return [
        call("w", "A", "gen", 0, 4),
        call("w", "A", "ver", 1, 2),
        call("w", "A", "gen", 3, 9),
        call("w", "B", "gen", 5, 6),
        call("w", "B", "gen", 5.5, 5.7),
        call("w", "C", "ver", 20, None),  # no end: still running (arrived, not complete)
        call("v", None, "gen", 1, 2),
    ]


@pytest.mark.parametrize("preserve", [True, False])
def test_connection_settings_and_tables_are_restored(write_store: Write, preserve: bool) -> None:
    reader = StoreReader(write_store(_rows()))
    try:
        con = reader.con
        con.execute(f"SET preserve_insertion_order = {str(preserve).lower()}")
        before = con.execute("SELECT count(*) FROM duckdb_tables()").fetchone()
        stats = summarise(con, reader.calls())
        assert stats["w"].requests == 2 and stats["v"].unidentified_calls == 1
        got = con.execute("SELECT current_setting('preserve_insertion_order')").fetchone()
        assert got == (preserve,)
        assert con.execute("SELECT count(*) FROM duckdb_tables()").fetchone() == before
        assert con.execute("SELECT count(*) FROM duckdb_views() WHERE NOT internal").fetchone() == (
            0,
        )
    finally:
        reader.close()


def test_the_shifted_layout_keeps_requests_apart(write_store: Write) -> None:
    reader = StoreReader(write_store(_rows()))
    try:
        got = scan(reader.con, reader.calls(), Bounds(None, None, None))
    finally:
        reader.close()
    assert got.workflows == ("v", "w")
    assert [m for _, m in got.pairs] == ["gen", "gen", "ver"]
    assert np.all(np.diff(got.call_a) >= 0)  # sorted by shifted start
    # request A spans [0, 9] s, B [5, 6] s; each owns [off, off + extent] and they don't touch
    assert got.smp_off.tolist() == [0, 9 * S + 1]
    assert got.smp_dur.tolist() == [(4 + 1 + 6) * S, (1 + 0.2) * S]
    assert got.smp_span.tolist() == [9 * S, 1 * S]
    a_of_b = got.call_a[got.call_a >= got.smp_off[1]]
    assert a_of_b.tolist() == [9 * S + 1, 9 * S + 1 + S // 2]
    assert got.arrivals.tolist() == [0, 3] and got.unidentified.tolist() == [1, 0]
    assert len(got.req_t0) == 2  # C is not complete
    # exact per pair (v/gen, w/gen, w/ver) over completed requests: A and B
    assert got.pair_calls.tolist() == [0, 4, 1]
    assert got.pair_dur.tolist() == [0, (4 + 6 + 1 + 0.2) * S, 1 * S]
    # the token histograms count finished calls only (an open row reports no usage)
    assert int(got.prompt.count.sum()) == len(_rows()) - 1
