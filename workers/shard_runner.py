"""Run one shard: lease it, submit its requests into the process's engine, wait, write its Parquet part.

The part is written atomically before the shard is marked done, and the task is acknowledged
only after that (late acks), so a redelivered shard overwrites its part instead of adding to it.
The shard is leased in the database (`store.lifecycle.shards.claim_shard`) and the lease renewed while it runs
(`workers.leases`): a redelivery while it runs is skipped, a worker that dies loses the shard to the
sweeper, and an attempt that lost its lease writes nothing. A worker shutting down (`drain`) aborts its
unfinished shards and hands them back; with a drain timeout it first stops taking shards (`stop_taking`) and
lets the running ones finish.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

from sqlalchemy.exc import DBAPIError

from batchfile.shard_input import decode_request
from broker.queue import enqueue_shards
from store.filestore.storage import get_storage
from store.filestore.storage_faults import classify, health, retrying
from store.filestore.storage_waits import WAITING, record_failure
from store.lifecycle.cancel import stop_reason
from store.lifecycle.finalize import maybe_finalize
from store.lifecycle.shards import claim_shard, finish_shard, owns_shard, release_shard, split_shard, storage_release
from store.results.parquet import count_results
from store.results.parts import results_store
from store.results.rows import cancelled_row, expired_row, request_failed_row
from store.settings import Settings
from workers import leases
from workers.line_requests import engine_request, result_row
from workers.progress import board as progress_board
from workers.sweeper import Recovery

log = logging.getLogger(__name__)

WORKER_NAME = socket.gethostname()
ENGINE_ERROR = "engine_error"
ATTEMPTS_EXHAUSTED = "shard_attempts_exhausted"
DB_RETRY_S = 60.0  # how long a finished shard waits for the database to come back before giving up

DONE, CANCELLED, SKIPPED, RELEASED, LOST, SPLIT = "done", "cancelled", "skipped", "released", "lost", "split"
STORAGE_WAIT, STORAGE_FAILED = "storage_wait", "storage_failed"  # handed back to wait out a storage failure

draining = threading.Event()  # set when this worker shuts down: running shards are aborted and handed back
closing = threading.Event()  # set when this worker stops taking shards (the running ones go on)
_in_flight: dict[str, list[str]] = {}  # shard id -> its request ids in the engine
_in_flight_lock = threading.Lock()


def job_of(shard_id: str) -> str:
    return shard_id.rsplit(".", 1)[0]


def with_db_retry(fn, *args, **kwargs):
    """Call `fn`, retrying while the database is unreachable (a restart), for up to DB_RETRY_S seconds."""
    deadline = time.monotonic() + DB_RETRY_S
    delay = 0.2
    while True:
        try:
            return fn(*args, **kwargs)
        except DBAPIError as exc:
            if not exc.connection_invalidated and "connect" not in str(exc).lower():
                raise
            if time.monotonic() > deadline:
                raise
            log.warning("database unavailable (%s); retrying in %.1fs", type(exc.orig).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def stop_taking() -> None:
    """Shutting down gracefully: shards delivered from now on go back to the queue unstarted."""
    closing.set()


def drain(host) -> int:
    """Shutting down: abort every shard's requests; the shards are handed back, not written."""
    closing.set()
    draining.set()
    with _in_flight_lock:
        request_ids = [rid for ids in _in_flight.values() for rid in ids]
    return host.abort(request_ids) if request_ids else 0


def _read_requests(settings: Settings, key: str):
    def read():
        shared_params: dict = {}
        with get_storage(settings.storage_url).open_read(key) as f:
            return [decode_request(line, shared_params) for line in f if line.strip()]

    return retrying(read, "reading a shard's input")


@dataclass
class _Attempt:
    """One attempt's requests in the engine: their futures, when each started and finished, and which
    ones already have their row in the part (their outputs are dropped as soon as the row is written)."""

    request_ids: list[str]
    requests: dict
    futures: dict[str, concurrent.futures.Future] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    written: set[str] = field(default_factory=set)
    done: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # request ids, as they finish
    lost: threading.Event = field(default_factory=threading.Event)

    def on_done(self, request_id: str) -> None:
        self.finished[request_id] = time.time()
        self.done.put(request_id)

    def times(self, request_id: str, created_at) -> dict:
        return {
            "created_at": created_at,
            "started_at": self.started.get(request_id),
            "finished_at": self.finished.get(request_id),
        }


def run_shard(settings: Settings, host, watcher, shard_id: str) -> str:
    """Returns what happened: "done", "cancelled", "skipped", "released", "lost", "split", or, when the storage
    failed, "storage_wait" (handed back at once, the sweeper sends it again after a backoff; the reason is on
    the job) or "storage_failed" (a permanent storage failure failed the job)."""
    if closing.is_set():
        return RELEASED
    recovery = Recovery.from_env()
    claim = with_db_retry(claim_shard, settings, shard_id, WORKER_NAME, recovery.lease_s, recovery.max_attempts)
    if claim is None:  # done already (a redelivery), cancelled while queued, or running elsewhere
        with_db_retry(maybe_finalize, settings, job_of(shard_id))
        return SKIPPED
    try:
        return _run_claimed(settings, host, watcher, shard_id, claim, recovery)
    except Exception as exc:
        if classify(exc) is None:
            raise
        release = storage_release(shard_id, claim.attempt)
        outcome = with_db_retry(
            record_failure,
            settings,
            claim.job_id,
            exc,
            "writing a shard's results",
            "writing results will retry",
            release,
        )
        return STORAGE_WAIT if outcome == WAITING else STORAGE_FAILED


def _run_claimed(settings: Settings, host, watcher, shard_id: str, claim, recovery: Recovery) -> str:
    if claim.exhausted:  # poison work: every attempt so far killed or lost its worker
        return _bisect_or_fail(settings, shard_id, claim, recovery)
    requests = _read_requests(settings, claim.input_key)
    t0 = time.time()
    part = results_store(settings).open_part(claim.job_id, shard_id)
    try:
        outcome = _run_and_write(settings, host, watcher, shard_id, claim, requests, recovery.lease_s, part)
    except BaseException:
        part.discard()
        raise
    if outcome in (LOST, RELEASED):
        part.discard()
        return outcome
    counts = _commit_part(settings, shard_id, part, claim.attempt)
    if counts is None:
        return LOST
    health.worked()
    log.info(
        "shard %s: %d completed, %d failed, %d cancelled in %.2fs (at most %d rows held)",
        shard_id,
        counts.completed,
        counts.failed,
        counts.cancelled,
        time.time() - t0,
        part.max_rows_held,
    )
    with_db_retry(maybe_finalize, settings, claim.job_id)
    return CANCELLED if counts.cancelled else DONE


def _bisect_or_fail(settings: Settings, shard_id: str, claim, recovery: Recovery) -> str:
    """A shard whose attempts are used up: split into two halves with fresh attempts, so that its innocent
    requests still run; a single request is failed alone."""
    with get_storage(settings.storage_url).open_read(claim.input_key) as f:
        lines = [line if line.endswith(b"\n") else line + b"\n" for line in f if line.strip()]
    if len(lines) > 1:
        half = len(lines) // 2
        new = with_db_retry(
            split_shard, settings, shard_id, claim.attempt, [lines[:half], lines[half:]], recovery.requeue_s
        )
        if new is None:
            return LOST
        log.error(
            "shard %s: %d attempts used up; split its %d requests into %s",
            shard_id,
            claim.attempt - 1,
            len(lines),
            ", ".join(sid for sid, _ in new),
        )
        results_store(settings).open_part(claim.job_id, shard_id).discard_with_leftovers()  # dead attempts' files
        enqueue_shards(settings, new)
        return SPLIT
    log.error("shard %s: %d attempts used up; failing its request", shard_id, claim.attempt - 1)
    message = (
        f"the request was started {claim.attempt - 1} times and never finished (its worker died or "
        "lost it each time); it was not run again"
    )
    _fail_requests(settings, shard_id, claim, ATTEMPTS_EXHAUSTED, message)
    return DONE


def _run_and_write(settings: Settings, host, watcher, shard_id: str, claim, requests, lease_s, part) -> str:
    """Run the shard's requests, each row into `part` as its request finishes; then the stopped ones' rows."""
    attempt = _run_in_engine(settings, host, watcher, shard_id, claim, requests, lease_s, part)
    if attempt.lost.is_set():
        return LOST
    stopped = [rid for rid in attempt.request_ids if rid not in attempt.written]
    reason = with_db_retry(stop_reason, settings, claim.job_id) if stopped else None
    if stopped and reason is None:
        # aborted, but the job goes on: this worker is shutting down; the next one runs the shard
        if with_db_retry(release_shard, settings, shard_id, claim.attempt):
            log.info("shard %s handed back (%d requests unfinished)", shard_id, len(stopped))
        return RELEASED
    make_row = expired_row if reason == "expired" else cancelled_row  # never ran, or aborted
    for request_id in stopped:
        part.add(
            make_row(attempt.requests[request_id], shard_id=shard_id, **attempt.times(request_id, claim.job_created_at))
        )
    return DONE


def _run_in_engine(settings: Settings, host, watcher, shard_id: str, claim, requests, lease_s: float, part) -> _Attempt:
    """Submit the shard's requests (unless the job is stopping) under a held lease; write each one's row."""
    request_ids = [f"{shard_id}/{claim.attempt}/{req.line}" for req in requests]
    attempt = _Attempt(request_ids, dict(zip(request_ids, requests)))

    def on_lost() -> None:
        attempt.lost.set()
        host.abort(attempt.request_ids)

    keeper = leases.keeper(settings, lease_s)
    keeper.hold(shard_id, claim.attempt, on_lost)
    watcher.register(claim.job_id, attempt.request_ids)
    with _in_flight_lock:
        _in_flight[shard_id] = attempt.request_ids
    try:
        if not (claim.job_cancelling or watcher.is_cancelled(claim.job_id) or draining.is_set()):
            batch = [engine_request(rid, req) for rid, req in zip(attempt.request_ids, requests)]
            now = time.time()
            # no name for the list of futures: each output must go as soon as its row is written
            for request_id, future in zip(
                attempt.request_ids,
                host.submit_many(
                    batch,
                    tenant=claim.tenant,
                    weight=claim.tenant_weight,
                    priority=claim.priority,
                    deadline=claim.deadline,
                ),
            ):
                attempt.started[request_id] = now
                attempt.futures[request_id] = future
                future.add_done_callback(lambda _f, rid=request_id: attempt.on_done(rid))
        progress = progress_board.track(settings, shard_id, claim.attempt)
        try:
            _write_as_finished(attempt, part, shard_id, claim.job_created_at, host.tokenizer, progress)
        finally:
            progress.close()
    except BaseException:
        host.abort(attempt.request_ids)  # the part could not be written (the storage failed): stop its requests
        raise
    finally:
        with _in_flight_lock:
            _in_flight.pop(shard_id, None)
        watcher.unregister(claim.job_id, attempt.request_ids)
        keeper.drop(shard_id)
    return attempt


def _write_as_finished(attempt: _Attempt, part, shard_id: str, created_at, tokenizer, progress) -> None:
    """Each finished request's row goes to the part (completed, or failed in the engine); its output is
    dropped at once. Aborted requests (their future resolved to None) are left for the caller."""
    for _ in range(len(attempt.futures)):
        request_id = attempt.done.get()
        row = _row(attempt, request_id, attempt.futures.pop(request_id), shard_id, created_at, tokenizer)
        if row is not None:
            part.add(row)
            attempt.written.add(request_id)
            progress.add(row)


def _row(attempt: _Attempt, request_id: str, future, shard_id: str, created_at, tokenizer) -> dict | None:
    if attempt.lost.is_set() or _stopped(future):
        return None
    req, times = attempt.requests[request_id], attempt.times(request_id, created_at)
    if future.exception() is not None:
        exc = future.exception()
        message = f"{type(exc).__name__}: {exc}"
        return request_failed_row(req, ENGINE_ERROR, message, shard_id=shard_id, **times)
    return result_row(req, future.result(), shard_id=shard_id, tokenizer=tokenizer, **times)


def _stopped(future) -> bool:
    """Aborted: its future resolved to None."""
    return future.exception() is None and future.result() is None


def fail_shard(settings: Settings, shard_id: str, error: str) -> None:
    """After the last retry: every request of the shard is recorded as failed, so the job can finish."""
    claim = claim_shard(settings, shard_id, WORKER_NAME, Recovery.from_env().lease_s)
    if claim is None:
        return
    _fail_requests(settings, shard_id, claim, ENGINE_ERROR, f"the shard failed: {error}")


def _fail_requests(settings: Settings, shard_id: str, claim, code: str, message: str) -> None:
    """Record every request of the claimed shard as failed with `code`, so that its job can finish."""
    rows = [
        request_failed_row(req, code, message, shard_id=shard_id, created_at=claim.job_created_at)
        for req in _read_requests(settings, claim.input_key)
    ]
    _write_part(settings, claim.job_id, shard_id, rows, attempt=claim.attempt)
    with_db_retry(maybe_finalize, settings, claim.job_id)


def _write_part(settings: Settings, job_id: str, shard_id: str, rows: list[dict], attempt: int | None = None):
    """Write the part (atomically) from `rows`, count what was written, then mark the shard done."""
    part = results_store(settings).open_part(job_id, shard_id)
    try:
        for row in rows:
            part.add(row)
    except BaseException:
        part.discard()
        raise
    return _commit_part(settings, shard_id, part, attempt)


def _commit_part(settings: Settings, shard_id: str, part, attempt: int | None):
    """Move the part into place, count it, then mark the shard done; returns the counts.

    With `attempt`, a stale attempt (the shard was taken over) writes nothing and returns None.
    """
    if attempt is not None and not with_db_retry(owns_shard, settings, shard_id, attempt):
        log.warning("shard %s: attempt %d was taken over; its result is dropped", shard_id, attempt)
        part.discard()
        return None
    path = part.commit()
    store = results_store(settings)
    counts = retrying(lambda: count_results(store.url_for(path)), "counting a shard's results")
    if not with_db_retry(finish_shard, settings, shard_id, path, counts, attempt):
        log.warning("shard %s: attempt %d was taken over while writing", shard_id, attempt)
        return None
    return counts
