"""Running shards' counts, written to their rows by one thread per worker process every PROGRESS_S, so
that a job's request_counts move per request rather than per shard.

The shard runners only record counts here (no database call on their path: a slow or unreachable
database never holds a request's row back); `finish_shard` then sets the counts from the written part.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from store.lifecycle.shards import report_progress
from store.results.parquet import ResultCounts
from store.settings import Settings

log = logging.getLogger(__name__)

PROGRESS_S = 1.0  # how often running shards' counts are written


class ShardProgress:
    """One attempt's counts so far."""

    def __init__(self, board: ProgressBoard, settings: Settings, shard_id: str, attempt: int):
        self.board, self.settings, self.shard_id, self.attempt = board, settings, shard_id, attempt
        self.counts = ResultCounts()

    def add(self, row: dict) -> None:
        with self.board.lock:
            status = row["status"]
            setattr(self.counts, status, getattr(self.counts, status) + 1)
            if status == "completed":
                self.counts.prompt_tokens += row["prompt_tokens"] or 0
                self.counts.completion_tokens += row["completion_tokens"] or 0
                self.counts.cached_tokens += row.get("cached_tokens") or 0
            self.board.dirty.add(self)

    def close(self) -> None:
        with self.board.lock:
            self.board.dirty.discard(self)


class ProgressBoard:
    def __init__(self, interval_s: float = PROGRESS_S):
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self.dirty: set[ShardProgress] = set()
        self._thread: threading.Thread | None = None

    def track(self, settings: Settings, shard_id: str, attempt: int) -> ShardProgress:
        with self.lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="shard-progress", daemon=True)
                self._thread.start()
        return ShardProgress(self, settings, shard_id, attempt)

    def _loop(self) -> None:
        stop = threading.Event()
        while not stop.wait(self.interval_s):
            self.flush()

    def flush(self) -> None:
        with self.lock:
            due = [(p, dataclasses.replace(p.counts)) for p in self.dirty]
            self.dirty.clear()
        for progress, counts in due:
            try:
                report_progress(progress.settings, progress.shard_id, progress.attempt, counts)
            except Exception:  # progress is a hint; the part holds the truth
                log.warning("shard %s: progress not recorded", progress.shard_id, exc_info=True)


board = ProgressBoard()  # this process's
