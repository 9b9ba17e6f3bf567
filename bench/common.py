"""What every benchmark shares: the machine description and the JSON result file."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import orjson

RESULTS = Path(__file__).parent / "results"


def machine(redis_version: str = "") -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "redis": redis_version,
    }


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    return path


def median(values: list[float]) -> float:
    return statistics.median(values)
