"""Log set-up: human lines by default, one JSON object per line with ``--log-format json``.

The level given applies to gpupool's own loggers only; every other library logs warnings and
worse. Libraries at debug level print what they handle: botocore prints the S3 access key id and
signed headers, redis-py the commands it sends (with their arguments).

A line that cannot be written (stderr was a terminal that is gone: EIO; a pipe whose reader
exited: EPIPE) is dropped by logging itself, and poold goes on (tests/daemon/test_poold.py).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

# The loggers `level` is for: every module of gpupool logs under one of these.
OWN_LOGGERS = ("daemon", "protocol", "storage", "poold", "bench")

# Extra fields a log call may carry (logger.info(..., extra={"job": id})) and JSON lines keep.
CONTEXT_FIELDS = ("job", "worker", "queue", "attempt", "user", "peer")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "component": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            if (value := getattr(record, name, None)) is not None:
                data[name] = value
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(data, default=str).decode()


def setup(fmt: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter()
        formatter.converter = __import__("time").gmtime
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_level(level)


def set_level(level: str) -> None:
    """`level` for gpupool's own loggers, warnings and worse for every other: at the start, and at
    a reload (daemon/reload.py)."""
    own = logging.getLevelName(level.upper())
    logging.getLogger().setLevel(max(own, logging.WARNING))
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(own)
