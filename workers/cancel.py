"""Learns of cancelled jobs by polling the job store, and aborts their requests in the engine."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

from store.lifecycle.cancel import cancelling_jobs
from store.settings import Settings

log = logging.getLogger(__name__)


class CancelWatcher:
    def __init__(self, settings: Settings, host):
        self.settings = settings
        self.host = host
        self._running: dict[str, set[str]] = defaultdict(set)  # job id -> request ids in the engine
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cancel-watcher", daemon=True)
        self._thread.start()

    def register(self, job_id: str, request_ids) -> None:
        with self._lock:
            self._running[job_id].update(request_ids)
            cancelled = job_id in self._cancelled
        if cancelled:
            self.host.abort(list(request_ids))

    def unregister(self, job_id: str, request_ids) -> None:
        with self._lock:
            running = self._running.get(job_id)
            if running is not None:
                running.difference_update(request_ids)
                if not running:
                    del self._running[job_id]

    def is_cancelled(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._cancelled

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.cancel_poll_s):
            with self._lock:
                job_ids = list(self._running)
            if not job_ids:
                continue
            try:
                cancelled = cancelling_jobs(self.settings, job_ids)
            except Exception:  # a database hiccup must not kill the watcher
                log.exception("polling for cancelled jobs failed")
                continue
            for job_id in cancelled:
                with self._lock:
                    self._cancelled.add(job_id)
                    request_ids = list(self._running.get(job_id, ()))
                if request_ids:
                    n = self.host.abort(request_ids)
                    log.info("job %s cancelled: aborted %d requests", job_id, n)
