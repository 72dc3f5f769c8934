"""The S3 client's own retries, made visible.

botocore (and s3fs around it) retry a failed S3 call before our code sees it, so a store failing a tenth of
its calls looks healthy from above. `observe` hooks botocore's `needs-retry` event, which fires after every
HTTP attempt of every client s3fs makes for a file system: each attempt that failed transiently (5xx,
throttling, a timeout, a dropped connection) is counted as a transient storage error (op `S3 <Operation>`),
and `recent` keeps per-second counts of the last `WINDOW_S` seconds (bounded), so the readiness check can say
the storage is degraded while a sustained share of calls is being retried (`retrying`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque

from store.filestore.storage_faults import TRANSIENT, classify, health, s3_kind

log = logging.getLogger(__name__)

WINDOW_S = 60  # retries this recent count
MIN_FAILED = 3  # at least this many failed attempts in the window ...
MIN_SHARE = 0.02  # ... and at least this share of the attempts: the readiness check says degraded
_HANDLER_ID = "pagedbatch-storage-retries"


class _Recent:
    """S3 attempts and failed attempts per second over the last WINDOW_S seconds."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seconds: deque[list[int]] = deque(maxlen=WINDOW_S)  # [second, attempts, failed]
        self.logged = False

    def record(self, failed: bool) -> None:
        now = int(time.monotonic())
        with self.lock:
            if not self.seconds or self.seconds[-1][0] != now:
                self.seconds.append([now, 0, 0])
            self.seconds[-1][1] += 1
            self.seconds[-1][2] += failed
        if failed and not self.logged and (reason := self.retrying()):
            self.logged = True  # once per condition, again after a window without one
            log.warning("%s", reason)

    def counts(self) -> tuple[int, int]:
        """(attempts, failed attempts) in the last WINDOW_S seconds."""
        since = int(time.monotonic()) - WINDOW_S
        with self.lock:
            recent = [s for s in self.seconds if s[0] > since]
        return sum(s[1] for s in recent), sum(s[2] for s in recent)

    def retrying(self) -> str | None:
        """A reason ("storage_retrying: ...") while a sustained share of S3 attempts fails; else None."""
        attempts, failed = self.counts()
        if failed < MIN_FAILED or failed < MIN_SHARE * attempts:
            self.logged = False
            return None
        return (
            f"storage_retrying: {failed} of {attempts} S3 calls in the last {WINDOW_S}s failed "
            "and were retried by the S3 client"
        )


recent = _Recent()


def _attempted(response=None, caught_exception=None, operation=None, **_kwargs) -> None:
    """botocore's `needs-retry` event, after each attempt; returns None (the retry decision is botocore's)."""
    if caught_exception is not None:
        failed = classify(caught_exception) == TRANSIENT
    elif response is not None and isinstance(response[1], dict):
        parsed = response[1]
        code = str(parsed.get("Error", {}).get("Code") or "")
        status = int(parsed.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        failed = status >= 400 and s3_kind(code, status) == TRANSIENT
    else:
        failed = False
    recent.record(failed)
    if failed:
        health.count(TRANSIENT, f"S3 {getattr(operation, 'name', 'call')}")


def observe(fs) -> None:
    """Count the retries of every S3 client that s3fs creates for `fs` (an s3fs file system)."""
    if "set_session" in vars(fs):
        return
    set_session = fs.set_session
    clients: weakref.WeakSet = weakref.WeakSet()

    async def observed_set_session(*args, **kwargs):  # s3fs awaits it before every call
        client = await set_session(*args, **kwargs)
        if client not in clients:
            client.meta.events.register("needs-retry.s3", _attempted, unique_id=_HANDLER_ID)
            clients.add(client)
        return client

    fs.set_session = observed_set_session
