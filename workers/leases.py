"""Shard leases, renewed by one heartbeat thread per worker process while the shards run.

A shard whose lease is not renewed (its worker died, hung or lost the database for too long) is taken
back by the sweeper and run again by another worker. When a renewal finds that the shard is no longer
this worker's attempt, the shard's `on_lost` callback aborts its requests: its result would be ignored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from store.lifecycle.shards import renew_leases
from store.settings import Settings

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, settings: Settings, lease_s: float):
        self.settings = settings
        self.lease_s = lease_s
        self._held: dict[str, tuple[int, Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lease-keeper", daemon=True)
        self._thread.start()

    def hold(self, shard_id: str, attempt: int, on_lost: Callable[[], None]) -> None:
        with self._lock:
            self._held[shard_id] = (attempt, on_lost)

    def drop(self, shard_id: str) -> None:
        with self._lock:
            self._held.pop(shard_id, None)

    def held(self) -> dict[str, int]:
        with self._lock:
            return {shard_id: attempt for shard_id, (attempt, _) in self._held.items()}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            held = self.held()
            if not held:
                continue
            try:
                lost = renew_leases(self.settings, held, self.lease_s)
            except Exception:  # the database is away: try again; the lease may run out
                log.warning("renewing %d shard leases failed", len(held), exc_info=True)
                continue
            for shard_id in lost:
                with self._lock:
                    entry = self._held.pop(shard_id, None)
                if entry is not None and entry[0] == held[shard_id]:
                    log.warning("shard %s: lease lost (another worker took it over); abandoning it", shard_id)
                    entry[1]()


_keepers: dict[str, LeaseKeeper] = {}
_keepers_lock = threading.Lock()


def keeper(settings: Settings, lease_s: float) -> LeaseKeeper:
    """This process's lease keeper for `settings`' database (started on first use)."""
    with _keepers_lock:
        found = _keepers.get(settings.database_url)
        if found is None:
            found = _keepers[settings.database_url] = LeaseKeeper(settings, lease_s)
        return found
