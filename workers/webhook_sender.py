"""The workers' webhook sender: a thread that turns ended jobs into deliveries and sends those due.

At least once: a delivery stays pending until its endpoint answers 2xx, each attempt leased so that the
senders of several workers do not send it together; a sender that dies mid-attempt leaves it to be sent
again when the lease passes. Waits between attempts double (`store.callbacks.webhooks.record_attempt`). The URL is
checked again before each attempt (`store.callbacks.webhook_urls`): a name that now resolves to a refused address is
an attempt that failed.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from store.callbacks.webhook_events import Answer, post, signed_headers
from store.callbacks.webhook_urls import check_url
from store.callbacks.webhooks import announce_ended_jobs, due_deliveries, record_attempt, signing_secrets
from store.errors import StoreError
from store.settings import Settings

log = logging.getLogger(__name__)


def send_due(settings: Settings, room: int | None = None, submit=None) -> int:
    """Announce ended jobs and start one attempt at each due delivery (at most `room` of them), each through
    `submit(fn)` (default: run it here); returns the attempts started."""
    announce_ended_jobs(settings)
    submit = submit or (lambda fn: fn())
    started = 0
    while room is None or started < room:
        batch = due_deliveries(settings, lease_s=settings.webhook_timeout_s * 3, limit=_claim_limit(room, started))
        if not batch:
            break
        for delivery, endpoint in batch:
            submit(lambda d=delivery, e=endpoint: _attempt_and_record(settings, d, e))
            started += 1
    return started


def _claim_limit(room: int | None, started: int) -> int:
    return 20 if room is None else min(20, room - started)


def _attempt_and_record(settings: Settings, delivery, endpoint) -> None:
    answer = _attempt(settings, delivery, endpoint)
    record_attempt(settings, delivery.id, answer.status_code, answer.error)
    if not answer.ok:
        log.info("webhook %s to %s: %s", delivery.event_type, endpoint.url, answer.error)


def _attempt(settings: Settings, delivery, endpoint) -> Answer:
    try:
        check_url(settings, endpoint.url)
    except StoreError as exc:
        return Answer(0, exc.message[:500])
    headers = signed_headers(signing_secrets(endpoint), delivery.event_id, delivery.body)
    return post(endpoint.url, delivery.body, headers, settings.webhook_timeout_s)


class WebhookSender:
    """Every `settings.webhook_poll_s` seconds (PAGEDBATCH_WEBHOOK_POLL_S), on a daemon thread, claims the due
    deliveries it has room for and attempts them on a pool of `webhook_concurrency` threads, so that an endpoint
    that answers slowly (up to `webhook_timeout_s`) or not at all holds one thread, not every other tenant's events."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.poll_s = settings.webhook_poll_s
        self._pool = ThreadPoolExecutor(settings.webhook_concurrency, thread_name_prefix="webhook-attempt")
        self._in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="webhook-sender", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                with self._lock:
                    room = self.settings.webhook_concurrency - self._in_flight
                send_due(self.settings, room=room, submit=self._submit)
            except Exception:  # noqa: BLE001 - the database is down: try again next time
                log.warning("webhook sending failed", exc_info=True)

    def _submit(self, attempt) -> None:
        with self._lock:
            self._in_flight += 1
        self._pool.submit(self._run, attempt)

    def _run(self, attempt) -> None:
        try:
            attempt()
        except Exception:  # noqa: BLE001 - recording failed (database down): the lease lets it be sent again
            log.warning("webhook attempt failed", exc_info=True)
        finally:
            with self._lock:
                self._in_flight -= 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
