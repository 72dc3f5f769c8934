"""One engine per worker process, driven by a background thread; callers get per-request futures.

Many shard tasks (threads) submit into the same engine, so each step batches requests from many
shards and jobs. `abort` frees a request's blocks at once and resolves its future with None.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import Future

log = logging.getLogger(__name__)


class EngineHost:
    def __init__(self, engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def submit(self, request_id: str, prompt, params) -> Future:
        """Add a request; the future resolves to its RequestOutput (None if aborted).

        Bad input resolves the future with the engine's ValueError instead of raising here.
        """
        future: Future = Future()
        with self._lock:
            if request_id in self._futures:
                raise ValueError(f"request {request_id!r} is already running")
            self._futures[request_id] = future
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
            with self._lock:
                self._futures.pop(request_id, None)
            future.set_exception(exc)
            return future
        self._wake.set()
        return future

    def abort(self, request_ids) -> int:
        aborted = 0
        for request_id in request_ids:
            with self._lock:
                future = self._futures.pop(request_id, None)
            if future is None:
                continue
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001
                log.exception("abort of %s failed", request_id)
            future.set_result(None)
            aborted += 1
        return aborted

    def pending(self) -> int:
        with self._lock:
            return len(self._futures)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_unfinished_requests():
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail what is in flight, keep serving
                log.exception("engine step failed")
                with self._lock:
                    futures, self._futures = self._futures, {}
                for request_id, future in futures.items():
                    with contextlib.suppress(Exception):
                        self.engine.abort_request(request_id)
                    future.set_exception(exc)
                continue
            for output in outputs:
                if not getattr(output, "finished", True):
                    continue
                with self._lock:
                    future = self._futures.pop(output.request_id, None)
                if future is not None:
                    future.set_result(output)


_host: EngineHost | None = None
_host_lock = threading.Lock()


def set_host(host: EngineHost) -> None:
    global _host
    with _host_lock:
        _host = host


def get_host() -> EngineHost:
    if _host is None:
        raise RuntimeError("no engine loaded in this process; start it with `pagedbatch worker --model`")
    return _host
