"""Helpers for optimizer tests: crafted call records written through the real segment writer."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shared.records import CallRecord
from shared.store import SegmentWriter

S = 1_000_000  # microseconds per second
_ids = itertools.count()

Row = tuple[Any, ...]


def call(
    workflow: str | None,
    request_id: str | None,
    model: str,
    start_s: float,
    end_s: float | None,
    *,
    call_id: str | None = None,
    attempt: int = 0,
    prompt: int | None = 10,
    completion: int | None = 5,
    status: int | None = 200,
) -> Row:
    """One record row; times in seconds from 0 (stored as microseconds)."""
    return CallRecord(
        call_id=call_id or f"c{next(_ids)}",
        proxy_id="test",
        workflow=workflow,
        request_id=request_id,
        model=model,
        endpoint="/v1/chat/completions",
        attempt=attempt,
        status=status,
        t_start=round(start_s * S),
        t_end=None if end_s is None else round(end_s * S),
        prompt_tokens=prompt,
        completion_tokens=completion,
    ).row()


@pytest.fixture
def write_store(tmp_path: Path) -> Callable[[list[Row]], Path]:
    def write(rows: list[Row]) -> Path:
        writer = SegmentWriter(tmp_path, "test")
        try:
            writer.write(rows)
        finally:
            writer.close()
        return tmp_path

    return write
