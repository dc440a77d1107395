"""How the evaluation's reports write numbers.

Role: one formatter for every figure ``bench.evaluation.report`` and
``bench.evaluation.dynamic_report`` print, so a missing or infinite value reads "-" everywhere.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["fmt"]


def fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}"
