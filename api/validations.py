"""New jobs validated off the request path: a bounded pool of threads per API process.

The pool holds only job ids (the jobs themselves wait in the database, `validating`), and at most
`max_concurrent_validations` run at once. It is started on first use, after gunicorn forked. A job
whose validation died with its process (a restart, a crash) is resumed from its last checkpoint
(`store.lifecycle.validating`): every RESUME_S each API process claims such jobs while it has idle validators,
and workers' sweepers do the same for the jobs of their models.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from functools import partial

from broker.queue import enqueue_shards
from store.lifecycle.validating import claim_validation, run_validation, stale_validations
from store.settings import Settings

log = logging.getLogger(__name__)

RESUME_S = 20.0  # how often an API process looks for validations whose validator died
_resumers: dict[str, threading.Thread] = {}  # database url -> this process's resumer thread
_resumers_lock = threading.Lock()


class ValidationPool:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._running: set[Future] = set()  # submitted, not finished (job ids only: bounded by job limits)

    @property
    def size(self) -> int:
        return max(self.settings.max_concurrent_validations, 1)

    def start_resumer(self) -> None:
        """Start this process's resumer of dead validations for this database, once (cheap after that:
        every request calls it, so that it runs in each gunicorn worker, after the fork)."""
        key = self.settings.database_url
        if key in _resumers:
            return
        with _resumers_lock:
            if key not in _resumers:
                _resumers[key] = threading.Thread(target=self._resume_loop, name="resume-validations", daemon=True)
                _resumers[key].start()

    def _resume_loop(self) -> None:
        while True:
            time.sleep(RESUME_S)
            try:
                self.resume_stale()
            except Exception as exc:  # the database is down: try again next time
                log.warning("looking for stale validations failed: %s", type(exc).__name__)

    def resume_stale(self) -> int:
        """Claim jobs whose validator died, as many as this pool has idle threads; returns how many."""
        with self._lock:
            idle = self.size - len(self._running)
        claimed = 0
        if idle <= 0:
            return 0
        for job_id in stale_validations(self.settings, limit=idle):
            owner = f"validator-{uuid.uuid4().hex}"
            if claim_validation(self.settings, job_id, owner):
                log.warning("resuming the validation of %s (its validator stopped)", job_id)
                self.submit(job_id, owner)
                claimed += 1
        return claimed

    def submit(self, job_id: str, owner: str):
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.size, thread_name_prefix="validate")
        enqueue = partial(enqueue_shards, self.settings)
        future = self._pool.submit(run_validation, self.settings, job_id, owner, enqueue)
        with self._lock:
            self._running.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future) -> None:
        with self._lock:
            self._running.discard(future)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every validation submitted so far (tests, and a graceful shutdown); True when none is left."""
        with self._lock:
            running = list(self._running)
        return not wait_futures(running, timeout).not_done

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=wait)
                self._pool = None
