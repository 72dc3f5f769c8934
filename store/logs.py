"""Logs as JSON lines or plain text, carrying the job id, shard id and tenant of the work in hand.

`log_context(job_id=..., shard_id=..., tenant=...)` sets them for the current thread (contextvars) while
a shard or a request is handled; every record logged meanwhile gets them as attributes, whichever logger
it comes from. `configure_logging` installs one root handler: `json` writes one object a line
(ts, level, logger, message, the ids that are set, exc_info), `text` the same as readable text.
The format comes from the argument, else PAGEDBATCH_LOG_FORMAT, else `text`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime

from settings import PlatformSettings, current

FORMATS = ("json", "text")
FORMAT_ENV = "PAGEDBATCH_LOG_FORMAT"
CONTEXT_FIELDS = ("job_id", "shard_id", "tenant")

_context: ContextVar[dict[str, str] | None] = ContextVar("pagedbatch_log_context", default=None)


@contextlib.contextmanager
def log_context(**ids: str | None) -> Iterator[None]:
    """Add ids (job_id, shard_id, tenant) to every record logged in this context; None leaves one out."""
    unknown = set(ids) - set(CONTEXT_FIELDS)
    if unknown:
        raise ValueError(f"unknown log context fields {sorted(unknown)}")
    token = _context.set({**(_context.get() or {}), **{k: v for k, v in ids.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


class ContextFilter(logging.Filter):
    """Copies the current context's ids onto the record (an id passed with `extra=` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in (_context.get() or {}).items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


def _ids(record: logging.LogRecord) -> dict[str, str]:
    return {name: getattr(record, name) for name in CONTEXT_FIELDS if getattr(record, name, None) is not None}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_ids(record),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        ids = _ids(record)
        if not ids:
            return text
        first, newline, rest = text.partition("\n")
        return first + " [" + " ".join(f"{k}={v}" for k, v in ids.items()) + "]" + newline + rest


def log_format(requested: str | None = None) -> str:
    chosen = (requested or current(PlatformSettings).log_format).lower()
    if chosen not in FORMATS:
        raise ValueError(f"log format {chosen!r}: expected one of {', '.join(FORMATS)} ({FORMAT_ENV})")
    return chosen


def configure_logging(level: str | int = "INFO", fmt: str | None = None, stream=None) -> logging.Handler:
    """Replace the root logger's handlers with one writing `fmt` (json or text) to `stream` (stderr)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format(fmt) == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler
