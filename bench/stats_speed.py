"""Benchmark: how long ``optimizer.stats`` takes to summarise millions of call records.

``python -m bench.stats_speed --out DIR [--quick] [--calls N]`` generates synthetic call records
straight into Parquet segments of the store layout (with DuckDB, so generation stays cheap),
then times ``summarise_store`` over them. Writes ``DIR/stats_speed.json``.

The synthetic trace: two workflows (a two-model loop with fan-out 4, and a three-model
sequential chain), 20 calls per request, 1% of calls retried once (an extra attempt-0 row),
0.1% of calls without a request id. Target: 10 M records in under 2 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import duckdb
import orjson

from optimizer.stats import summarise_store
from shared.records import COLUMNS
from shared.store import segment_dir

CALLS_PER_REQUEST = 20


def generate(store: Path, calls: int, segments: int) -> int:
    """Write ``calls`` logical calls (plus retry rows) as ``segments`` Parquet files."""
    directory = segment_dir(store, "bench")
    directory.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(":memory:")
    per = calls // segments
    rows = 0
    for seg in range(segments):
        first, last = seg * per, (seg + 1) * per if seg < segments - 1 else calls
        # i: call index; q: request; j: call within request; two workflows alternate.
        select = f"""
            WITH g AS (SELECT i, i // {CALLS_PER_REQUEST} AS q, i % {CALLS_PER_REQUEST} AS j,
                              hash(i) AS h FROM range({first}, {last}) t(i)),
            f AS (SELECT *, q % 2 AS wf, 1700000000000000 + q * 50000 AS t0 FROM g)
            SELECT
                printf('%016x', i) AS call_id, 'bench' AS proxy_id,
                CASE wf WHEN 0 THEN 'beam' ELSE 'rag' END AS workflow,
                CASE WHEN h % 1000 = 0 THEN NULL ELSE 'r' || q END AS request_id,
                CASE WHEN wf = 0 THEN (CASE WHEN j % 8 < 4 THEN 'gen' ELSE 'ver' END)
                     ELSE (CASE j % 3 WHEN 0 THEN 'emb' WHEN 1 THEN 'rerank' ELSE 'llm' END)
                END AS model,
                '/v1/chat/completions' AS endpoint, 'http://e' AS upstream,
                a.attempt, 200 AS status, NULL AS error, false AS stream,
                (CASE WHEN wf = 0 THEN t0 + (j // 4) * 400000 + (h % 50000)
                      ELSE t0 + j * 100000 END) AS t_start,
                NULL AS t_first_byte,
                (CASE WHEN wf = 0 THEN t0 + (j // 4) * 400000 + (h % 50000)
                      ELSE t0 + j * 100000 END) + 20000 + (h % 300000) AS t_end,
                100 + (h % 900)::INTEGER AS prompt_tokens,
                1 + (h % 200)::INTEGER AS completion_tokens, 0 AS cached_tokens,
                1000 AS request_bytes, 500 AS response_bytes, NULL AS body
            FROM f JOIN (SELECT 0 AS attempt UNION ALL SELECT 1) a
                ON a.attempt = 0 OR h % 100 = 7
        """
        typed = ", ".join(f"CAST({name} AS {sql}) AS {name}" for name, sql in COLUMNS)
        path = directory / f"seg-{seg:016d}-bench-{seg:06d}.parquet"
        con.execute(
            f"COPY (SELECT {typed} FROM ({select})) TO '{path}' (FORMAT parquet, COMPRESSION zstd)"
        )
        got = con.execute(f"SELECT count(*) FROM read_parquet('{path}')").fetchone()
        rows += int(got[0]) if got else 0
    con.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="1 M calls instead of 10 M")
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    calls = args.calls or (1_000_000 if args.quick else 10_000_000)
    args.out.mkdir(parents=True, exist_ok=True)
    store = Path(tempfile.mkdtemp(prefix="scepsy-stats-bench-"))
    try:
        t = time.perf_counter()
        rows = generate(store, calls, segments=max(1, calls // 1_000_000))
        gen_s = time.perf_counter() - t
        timings = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            stats = summarise_store(store)
            timings.append(time.perf_counter() - t)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    result = {
        "logical_calls": calls,
        "rows": rows,
        "cpus": os.cpu_count(),
        "generate_s": round(gen_s, 3),
        "summarise_s": [round(x, 3) for x in timings],
        "summarise_best_s": round(min(timings), 3),
        "target_s": 2.0,
        "workflows": {
            name: {"requests": wf.requests, "unidentified_calls": wf.unidentified_calls,
                   "models": {m: {"n": s.n, "p": s.p} for m, s in wf.models.items()}}
            for name, wf in stats.items()
        },
    }
    (args.out / "stats_speed.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(orjson.dumps({k: result[k] for k in ("rows", "summarise_s", "cpus")}).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
