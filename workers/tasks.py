"""The shard task, registered by name so the API can enqueue it without importing workers."""

from __future__ import annotations

import logging

from api.store.queue import RUN_SHARD

log = logging.getLogger(__name__)

MAX_RETRIES = 3

_state: dict = {}  # settings, host and cancel watcher of this worker process


def configure(settings, host, watcher) -> None:
    _state.update(settings=settings, host=host, watcher=watcher)


def register(app) -> None:
    @app.task(name=RUN_SHARD, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=MAX_RETRIES)
    def run_shard(self, shard_id: str) -> str:
        from workers import shard_runner

        settings = _state["settings"]
        try:
            return shard_runner.run_shard(settings, _state["host"], _state["watcher"], shard_id)
        except Exception as exc:
            if self.request.retries < MAX_RETRIES:
                log.warning("shard %s failed (%s); retrying", shard_id, exc)
                raise self.retry(exc=exc, countdown=2**self.request.retries) from exc
            log.exception("shard %s failed for good", shard_id)
            shard_runner.fail_shard(settings, shard_id, f"{type(exc).__name__}: {exc}")
            return "failed"
