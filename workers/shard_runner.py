"""Run one shard: submit its requests into the process's engine, wait, write its Parquet part.

The part is written atomically before the shard is marked done, and the task is acknowledged
only after that (late acks), so a redelivered shard overwrites its part instead of adding to it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import time

from api.store import lifecycle, parsing
from api.store import results as res
from api.store.settings import Settings
from api.store.storage import get_storage

log = logging.getLogger(__name__)

WORKER_NAME = socket.gethostname()
ENGINE_ERROR = "engine_error"


def job_of(shard_id: str) -> str:
    return shard_id.rsplit(".", 1)[0]


def _read_requests(settings: Settings, key: str):
    with get_storage(settings.storage_url).open_read(key) as f:
        return [parsing.decode_request(line) for line in f if line.strip()]


def run_shard(settings: Settings, host, watcher, shard_id: str) -> str:
    """Returns what happened: "done", "cancelled" or "skipped"."""
    claim = lifecycle.claim_shard(settings, shard_id, WORKER_NAME)
    if claim is None:  # done already (a redelivery), or cancelled while queued
        lifecycle.maybe_finalize(settings, job_of(shard_id))
        return "skipped"
    requests = _read_requests(settings, claim.input_key)
    request_ids = [f"{shard_id}/{claim.attempt}/{req.line}" for req in requests]
    futures: dict[str, concurrent.futures.Future] = {}
    started: dict[str, float] = {}
    finished: dict[str, float] = {}
    t0 = time.time()
    watcher.register(claim.job_id, request_ids)
    try:
        if not (claim.job_cancelling or watcher.is_cancelled(claim.job_id)):
            for request_id, req in zip(request_ids, requests):
                started[request_id] = time.time()
                future = host.submit(
                    request_id, {"prompt_token_ids": req.prompt_token_ids}, req.sampling_params
                )
                future.add_done_callback(lambda _f, rid=request_id: finished.__setitem__(rid, time.time()))
                futures[request_id] = future
        concurrent.futures.wait(futures.values())
    finally:
        watcher.unregister(claim.job_id, request_ids)

    rows = []
    for request_id, req in zip(request_ids, requests):
        future = futures.get(request_id)
        times = {
            "created_at": claim.job_created_at,
            "started_at": started.get(request_id),
            "finished_at": finished.get(request_id),
        }
        if future is None or (future.exception() is None and future.result() is None):
            rows.append(res.cancelled_row(req, shard_id=shard_id, **times))  # never ran, or aborted
        elif future.exception() is not None:
            exc = future.exception()
            rows.append(
                res.failed_row(
                    req.line,
                    req.custom_id,
                    ENGINE_ERROR,
                    f"{type(exc).__name__}: {exc}",
                    url=req.url,
                    model=req.model,
                    prompt_tokens=len(req.prompt_token_ids),
                    shard_id=shard_id,
                    **times,
                )
            )
        else:
            rows.append(
                res.completed_row(req, future.result(), shard_id=shard_id, tokenizer=host.tokenizer, **times)
            )
    counts = _write_part(settings, claim.job_id, shard_id, rows)
    log.info(
        "shard %s: %d completed, %d failed, %d cancelled in %.2fs",
        shard_id,
        counts.completed,
        counts.failed,
        counts.cancelled,
        time.time() - t0,
    )
    lifecycle.maybe_finalize(settings, claim.job_id)
    return "cancelled" if counts.cancelled else "done"


def fail_shard(settings: Settings, shard_id: str, error: str) -> None:
    """After the last retry: every request of the shard is recorded as failed, so the job can finish."""
    claim = lifecycle.claim_shard(settings, shard_id, WORKER_NAME)
    if claim is None:
        return
    rows = [
        res.failed_row(
            req.line,
            req.custom_id,
            ENGINE_ERROR,
            f"the shard failed: {error}",
            url=req.url,
            model=req.model,
            prompt_tokens=len(req.prompt_token_ids),
            shard_id=shard_id,
            created_at=claim.job_created_at,
        )
        for req in _read_requests(settings, claim.input_key)
    ]
    _write_part(settings, claim.job_id, shard_id, rows)
    lifecycle.maybe_finalize(settings, claim.job_id)


def _write_part(settings: Settings, job_id: str, shard_id: str, rows: list[dict]):
    """Write the part (atomically), count what was written, then mark the shard done."""
    store = lifecycle.results_store(settings)
    path = store.write_part(job_id, shard_id, rows)
    counts = res.count_results(store.url_for(path))
    lifecycle.finish_shard(settings, shard_id, path, counts)
    return counts
