"""`Restarter`: keeps `serve`'s child processes running: a process that exits is started again, after a
backoff that doubles while it keeps dying young, and every exit and restart is said on stderr."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MIN_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
HEALTHY_AFTER_S = 60.0  # a process that ran this long is healthy again: its backoff starts over


def say(message: str) -> None:
    print(f"pagedbatch: {message}", file=sys.stderr, flush=True)


@dataclass
class _Child:
    name: str
    start: Callable[[], subprocess.Popen]
    backoff_s: float
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # when a dead child is due to start again
    restarts: int = 0


class Restarter:
    """Starts each named process and restarts it when it exits, until `stop`."""

    def __init__(self, poll_s: float = 0.5):
        self._children: list[_Child] = []
        self._poll_s = poll_s
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="restarter", daemon=True)

    def add(self, name: str, start: Callable[[], subprocess.Popen]) -> None:
        child = _Child(name, start, MIN_BACKOFF_S)
        self._launch(child)
        with self._lock:
            self._children.append(child)
        if not self._thread.is_alive():
            self._thread.start()

    def _launch(self, child: _Child) -> None:
        child.proc, child.started_at, child.restart_at = child.start(), time.monotonic(), None
        say(f"{child.name} started (pid {child.proc.pid})")

    def _loop(self) -> None:
        while not self._stopping.wait(self._poll_s):
            with self._lock:
                for child in self._children:
                    self._check(child)

    def _check(self, child: _Child) -> None:
        now = time.monotonic()
        if child.restart_at is None:
            code = child.proc.poll()
            if code is None:
                return
            if now - child.started_at >= HEALTHY_AFTER_S:
                child.backoff_s = MIN_BACKOFF_S
            child.restart_at = now + child.backoff_s
            say(f"{child.name} (pid {child.proc.pid}) exited with code {code}; restarting it in {child.backoff_s:g}s")
            child.backoff_s = min(child.backoff_s * 2, MAX_BACKOFF_S)
        elif now >= child.restart_at and not self._stopping.is_set():
            child.restarts += 1
            self._launch(child)
            say(f"{child.name} restarted ({child.restarts} restarts so far)")

    def processes(self) -> list[subprocess.Popen]:
        with self._lock:
            return [child.proc for child in self._children if child.proc is not None]

    def stop(self, timeout: float = 30) -> None:
        """No more restarts; terminate every process (kill it after `timeout`)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        processes = self.processes()
        for proc in processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in processes:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
