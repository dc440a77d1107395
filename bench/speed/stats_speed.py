"""Benchmark: how long ``scepsy stats`` takes over millions of call records, end to end.

``python -m bench.speed.stats_speed --out DIR [--quick] [--calls N] [--repeat K] [--store PATH]``
generates synthetic call records straight into Parquet segments of the store layout (with
DuckDB, so generation stays cheap), then times what ``scepsy stats --store S --window all
--json`` spends. Writes ``DIR/stats_speed.json``.

What is timed (each ``--repeat`` times, best and all runs reported, with the load average):
- ``cli_s``: the command as a user runs it, in a fresh interpreter (``python -m
  optimizer.cli stats ...``, output to a pipe): interpreter start, imports, opening the store,
  reading every segment, the statistics and printing the JSON;
- ``in_process_s`` / ``in_process_cpu_s``: the same ``stats_report.run`` call inside this
  process (no interpreter start or imports), wall and CPU seconds (CPU over wall shows how
  much of the machine it had: 2 cores, and other work may be running);
- ``summarise_s``: ``summarise_store`` alone (reading the store and the statistics).

The synthetic trace: two workflows (a two-model loop with fan-out 4, and a three-model
sequential chain), 20 calls per request, a request every 50 ms (about 40 running at once),
1% of calls retried once (an extra attempt-0 row that failed with a 503), 0.1% of calls without a request id. Rows
are written in the order the proxy writes them, by end time, so calls of concurrent requests
interleave as in a real store. Target: 10 M records in under 2 s.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb
import orjson

from optimizer.cli.stats import add_arguments, run
from optimizer.stats.reader import summarise_store
from shared.records import COLUMNS
from shared.store import SEGMENT_CODEC, segment_dir

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
                a.attempt, CASE WHEN a.attempt = 0 AND h % 100 = 7 THEN 503 ELSE 200 END AS status,
                NULL AS error, false AS stream,
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
            f"COPY (SELECT {typed} FROM ({select}) ORDER BY t_end, call_id, attempt) "
            f"TO '{path}' (FORMAT parquet, COMPRESSION {SEGMENT_CODEC})"
        )
        got = con.execute(f"SELECT count(*) FROM read_parquet('{path}')").fetchone()
        rows += int(got[0]) if got else 0
    con.close()
    return rows


def _load() -> float:
    return (
        float(Path("/proc/loadavg").read_text().split()[0])
        if Path("/proc/loadavg").exists()
        else float("nan")
    )


def _cli_args(store: Path) -> list[str]:
    return ["stats", "--store", str(store), "--window", "all", "--json"]


def _time_cli(store: Path) -> float:
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "optimizer.cli", *_cli_args(store)],
        check=True,
        stdout=subprocess.PIPE,
    )
    return time.perf_counter() - t


def _time_in_process(store: Path) -> tuple[float, float]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(_cli_args(store)[1:])
    t, c = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        run(args)
    return time.perf_counter() - t, time.process_time() - c


def _series(values: list[float]) -> dict[str, Any]:
    return {"best": round(min(values), 3), "runs": [round(x, 3) for x in values]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="1 M calls instead of 10 M")
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--store", type=Path, default=None, help="generate into (or reuse) this folder and keep it"
    )
    args = ap.parse_args(argv)
    calls = args.calls or (1_000_000 if args.quick else 10_000_000)
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.store or Path(tempfile.mkdtemp(prefix="scepsy-stats-bench-"))
    try:
        t = time.perf_counter()
        reuse = args.store is not None and any(store.glob("calls/*/*.parquet"))
        rows = -1 if reuse else generate(store, calls, segments=max(1, calls // 1_000_000))
        gen_s = time.perf_counter() - t
        if reuse:
            got = (
                duckdb.connect()
                .execute(f"SELECT count(*) FROM '{store}/calls/*/*.parquet'")
                .fetchone()
            )
            rows = int(got[0]) if got else 0
        cli, inproc, inproc_cpu, summ, loads = [], [], [], [], []
        for _ in range(args.repeat):
            loads.append(_load())
            cli.append(_time_cli(store))
            wall, cpu = _time_in_process(store)
            inproc.append(wall)
            inproc_cpu.append(cpu)
            t = time.perf_counter()
            stats = summarise_store(store)
            summ.append(time.perf_counter() - t)
    finally:
        if args.store is None:
            shutil.rmtree(store, ignore_errors=True)
    result = {
        "logical_calls": calls,
        "rows": rows,
        "cpus": os.cpu_count(),
        "load_average_1m": loads,
        "generate_s": round(gen_s, 3),
        "command": "scepsy " + " ".join(_cli_args(Path("STORE"))),
        "cli_s": _series(cli),
        "in_process_s": _series(inproc),
        "in_process_cpu_s": _series(inproc_cpu),
        "summarise_s": _series(summ),
        "target_s": 2.0,
        "workflows": {
            name: {
                "requests": wf.requests,
                "unidentified_calls": wf.unidentified_calls,
                "models": {m: {"n": s.n, "p": s.p} for m, s in wf.models.items()},
            }
            for name, wf in stats.items()
        },
    }
    (args.out / "stats_speed.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(
        orjson.dumps(
            {
                k: result[k]
                for k in ("rows", "cli_s", "in_process_s", "in_process_cpu_s", "load_average_1m")
            }
        ).decode()
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
