"""Recorder throughput for the proxy benchmark: call records per second from submit to disk.

Role: drive :class:`proxy.recorder.Recorder` in-process the way the proxy does (``submit``
from the event loop, the writer task and its worker thread running meanwhile), then read the
segments back with :class:`shared.store.StoreReader` to prove every accepted record landed.

Invariants:
- the clock runs from the first ``submit`` to the return of ``Recorder.close()``, so the
  figure includes writing the last segment (records/s = records written / that wall time);
- submission yields to the loop every ``batch`` records (a proxy's handlers run between
  loop turns too), so the writer task is scheduled while submission goes on;
- the records are realistic rows (ids, times, tokens, a ~200-byte request body); a pool of
  distinct records is built before the clock starts and cycled.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from proxy.recorder import Recorder
from shared.records import CallRecord
from shared.settings import StoreSettings
from shared.store import StoreReader

POOL = 50_000


@dataclass(frozen=True)
class RecorderResult:
    records: int
    offered_per_s: float | None
    wall_s: float
    submit_s: float
    records_per_s: float
    written: int
    dropped: int
    segments: int
    on_disk: int
    segment_rows: int
    queue_size: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample_records(n: int) -> list[CallRecord]:
    """``n`` distinct, realistic finished call records."""
    t0 = time.time_ns() // 1000
    out = []
    for i in range(n):
        body = orjson.dumps(
            {
                "model": "bench",
                "messages": [
                    {"role": "system", "content": "You are a careful assistant."},
                    {"role": "user", "content": f"Question {i}: how many primes lie below {i}?"},
                ],
                "max_tokens": 128,
                "temperature": 0.7,
            }
        ).decode()
        start = t0 + i * 50
        out.append(
            CallRecord(
                call_id=uuid.uuid4().hex,
                proxy_id="bench",
                workflow="bench",
                request_id=f"req-{i // 8}",
                model="bench",
                endpoint="/v1/chat/completions",
                upstream="http://127.0.0.1:8000",
                status=200,
                stream=i % 2 == 0,
                t_start=start,
                t_first_byte=start + 180,
                t_end=start + 2_400,
                prompt_tokens=40 + i % 300,
                completion_tokens=1 + i % 128,
                cached_tokens=0,
                request_bytes=len(body),
                response_bytes=900 + i % 500,
                body=body,
            )
        )
    return out


def store_rows(path: str) -> int:
    """How many call records the store at ``path`` holds, read through the one reader."""
    reader = StoreReader(path)
    try:
        return int(reader.calls().aggregate("count(*)").fetchall()[0][0])
    finally:
        reader.close()


async def measure_recorder(
    records: int, rate: float | None = None, batch: int = 500, store: str | None = None
) -> RecorderResult:
    """Submit ``records`` call records through a fresh Recorder and time them onto disk;
    as fast as possible, or offered at ``rate`` records/s."""
    pool = sample_records(min(records, POOL))
    with tempfile.TemporaryDirectory(prefix="scepsy-bench-rec-") as tmp:
        settings = StoreSettings(path=store or tmp, segment_rows=50_000)
        rec = Recorder(settings, "bench-recorder")
        await rec.start()
        t0 = time.perf_counter()
        n = len(pool)
        # Paced: batch k is due at k * batch / rate seconds (sleep until then); unpaced: the
        # loop only yields.
        step = batch / rate if rate else 0.0
        for i in range(records):
            rec.submit(pool[i % n])
            if i % batch == batch - 1:
                lag = t0 + (i // batch + 1) * step - time.perf_counter()
                await asyncio.sleep(lag if lag > 0 else 0)
        t_submitted = time.perf_counter()
        await rec.close()
        wall = time.perf_counter() - t0
        on_disk = store_rows(settings.path)
    return RecorderResult(
        records=records,
        offered_per_s=rate,
        wall_s=round(wall, 3),
        submit_s=round(t_submitted - t0, 3),
        records_per_s=round(rec.written / wall, 1),
        written=rec.written,
        dropped=rec.dropped,
        segments=rec.segments,
        on_disk=on_disk,
        segment_rows=settings.segment_rows,
        queue_size=settings.queue_size,
    )
