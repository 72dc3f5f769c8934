"""New jobs validated off the request path: a bounded pool of threads per API process.

The pool holds only job ids (the jobs themselves wait in the database, `validating`), and at most
`max_concurrent_validations` run at once. It is started on first use, after gunicorn forked. A job
whose validation dies with this process is resumed by a worker's sweeper (`store.validating`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from functools import partial

from broker.queue import enqueue_shards
from store.settings import Settings
from store.validating import run_validation


class ValidationPool:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._running: set[Future] = set()  # submitted, not finished (job ids only: bounded by job limits)

    def submit(self, job_id: str, owner: str):
        with self._lock:
            if self._pool is None:
                workers = max(self.settings.max_concurrent_validations, 1)
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="validate")
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
