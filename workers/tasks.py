"""The shard task, registered by name so the API can enqueue it without importing workers."""

from __future__ import annotations

import logging
import threading
import time

from celery.exceptions import Reject
from celery.signals import task_postrun, task_prerun

from broker.queue import RUN_SHARD
from store.logs import log_context
from store.stats import tenant_of
from workers import shard_runner
from workers.sweeper import Sweeper
from workers.webhook_sender import WebhookSender

log = logging.getLogger(__name__)

MAX_RETRIES = 3

_state: dict = {}  # settings, host, cancel watcher, sweeper and metrics (optional) of this worker process
_log_contexts: dict = {}  # task id -> the log context of the shard task running it


def configure(settings, host, watcher, metrics=None, drain_s: float = 0.0) -> None:
    """Called once by `workers.process.run_worker` before the Celery worker starts; starts this process's sweeper.

    `drain_s`: on SIGTERM, how long running shards may go on before they are handed back (0: at once)."""
    _state.update(settings=settings, host=host, watcher=watcher, metrics=metrics, drain_s=drain_s)
    if "sweeper" not in _state:
        _state["sweeper"] = Sweeper(settings)
        _state["webhook_sender"] = WebhookSender(settings)


def on_shutdown(how: str = "Warm") -> None:
    """The worker is shutting down (Celery's signal handler calls this; it must not block for long).

    A warm shutdown (SIGTERM) with a drain timeout takes no new shard and lets the running ones finish, up to
    the timeout: Celery waits for them, acknowledges them and exits. Whatever still runs then, or at once on
    a cold shutdown, a second signal or without a drain timeout, is aborted and handed back to the queue."""
    host, drain_s = _state.get("host"), _state.get("drain_s", 0.0)
    sweeper = _state.pop("sweeper", None)
    if sweeper is not None:
        sweeper.close()
    sender = _state.pop("webhook_sender", None)
    if sender is not None:
        sender.close()
    if host is None:
        return
    if how == "Warm" and drain_s > 0 and not shard_runner.closing.is_set():
        shard_runner.stop_taking()
        timer = threading.Timer(drain_s, _hand_back, args=(host, f"still running after {drain_s:g}s of drain"))
        timer.daemon = True
        _state["drain_timer"] = timer
        timer.start()
        log.info("shutting down: taking no new shard; running shards may finish within %gs", drain_s)
        return
    _hand_back(host, "shutting down")


def _hand_back(host, why: str) -> None:
    timer = _state.pop("drain_timer", None)
    if timer is not None:
        timer.cancel()  # a second signal during the drain: no deadline left to wait for
    aborted = shard_runner.drain(host)
    log.info("%s: aborted %d requests; their shards are handed back", why, aborted)


def _timed(outcome_of, shard_id: str) -> str:
    """Run `outcome_of(shard_id)`, reporting its duration and outcome ("error" if it raised) to the metrics."""
    started, outcome = time.perf_counter(), "error"
    try:
        outcome = outcome_of(shard_id)
        return outcome
    finally:
        if _state.get("metrics") is not None:
            _state["metrics"].shard_done(outcome, time.perf_counter() - started)


def register(app) -> None:
    @app.task(name=RUN_SHARD, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=MAX_RETRIES)
    def run_shard(self, shard_id: str) -> str:
        outcome = _timed(lambda sid: _run_shard(self, sid), shard_id)
        if outcome == shard_runner.RELEASED:  # back to the queue for the next worker
            raise Reject("worker shutting down", requeue=True)
        return outcome

    # from before the task runs until after Celery logs its success, retry or failure
    task_prerun.connect(_enter_log_context, weak=False)
    task_postrun.connect(_leave_log_context, weak=False)


def _enter_log_context(sender=None, task_id=None, args=(), **_kwargs) -> None:
    if getattr(sender, "name", None) != RUN_SHARD or not args:
        return
    context = log_context(**_log_ids(args[0]))
    context.__enter__()
    _log_contexts[task_id] = context


def _leave_log_context(task_id=None, **_kwargs) -> None:
    context = _log_contexts.pop(task_id, None)
    if context is not None:
        context.__exit__(None, None, None)


def _log_ids(shard_id: str) -> dict:
    """The ids the shard's log lines carry; the tenant is left out when the database cannot say."""
    job_id = shard_runner.job_of(shard_id)
    try:
        tenant = tenant_of(_state["settings"], job_id)
    except Exception:  # the shard runner retries the database; logging does not wait for it
        tenant = None
    return {"job_id": job_id, "shard_id": shard_id, "tenant": tenant}


def _run_shard(task, shard_id: str) -> str:
    settings = _state["settings"]
    try:
        return shard_runner.run_shard(settings, _state["host"], _state["watcher"], shard_id)
    except Exception as exc:
        if task.request.retries < MAX_RETRIES:
            log.warning("shard %s failed (%s); retrying", shard_id, exc)
            raise task.retry(exc=exc, countdown=2**task.request.retries) from exc
        log.exception("shard %s failed for good", shard_id)
        shard_runner.fail_shard(settings, shard_id, f"{type(exc).__name__}: {exc}")
        return "failed"
