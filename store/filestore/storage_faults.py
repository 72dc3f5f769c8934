"""Storage errors, classified once: out of space or quota, permission, not found, transient, permanent.

Every layer that touches the storage (uploads, validation, shard parts, finalizing) hands what it caught to
`storage_fault`, which says what kind of failure it is (local `OSError`s by errno; S3 by the error code or
status s3fs and botocore carry, or the connection error's type), counts it by kind for the metrics, and logs
it once per condition (again only after the storage worked in between). A `StorageFault` carries a code
(`storage_full`, `storage_unavailable`, `storage_denied`) and a sentence for users: never the raw error text.
`retrying` runs a small idempotent call again with backoff while its failures are transient.
"""

from __future__ import annotations

import errno
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from store.errors import StoreError

log = logging.getLogger(__name__)

FULL, DENIED, NOT_FOUND, TRANSIENT, PERMANENT = "full", "denied", "not_found", "transient", "permanent"
KINDS = (FULL, DENIED, NOT_FOUND, TRANSIENT, PERMANENT)
RETRYABLE = (FULL, TRANSIENT)  # the storage comes back: wait and try again
CODES = {
    FULL: "storage_full",
    DENIED: "storage_denied",
    NOT_FOUND: "storage_unavailable",
    TRANSIENT: "storage_unavailable",
    PERMANENT: "storage_unavailable",
}
SENTENCES = {
    FULL: "The storage is full (no space left, or its quota is reached)",
    DENIED: "The platform is not allowed to use its storage (permission denied)",
    NOT_FOUND: "A file the job needs is missing from the storage",
    TRANSIENT: "The storage is not answering (unreachable, timing out or failing its requests)",
    PERMANENT: "The storage refused the request",
}

_ERRNO_KINDS = {
    errno.ENOSPC: FULL,
    errno.EDQUOT: FULL,
    errno.EFBIG: FULL,
    errno.EACCES: DENIED,
    errno.EPERM: DENIED,
    errno.EROFS: DENIED,
    errno.ENOENT: NOT_FOUND,
    errno.EIO: TRANSIENT,
    errno.EBUSY: TRANSIENT,
    errno.EAGAIN: TRANSIENT,
    errno.ETIMEDOUT: TRANSIENT,
    errno.ECONNRESET: TRANSIENT,
    errno.ECONNREFUSED: TRANSIENT,
    errno.ECONNABORTED: TRANSIENT,
    errno.EPIPE: TRANSIENT,
    errno.EHOSTUNREACH: TRANSIENT,
    errno.ENETUNREACH: TRANSIENT,
    errno.ENETDOWN: TRANSIENT,
    errno.EREMOTEIO: TRANSIENT,
}
_S3_CODES = {
    "SlowDown": TRANSIENT,
    "ServiceUnavailable": TRANSIENT,
    "InternalError": TRANSIENT,
    "RequestTimeout": TRANSIENT,
    "Throttling": TRANSIENT,
    "ThrottlingException": TRANSIENT,
    "RequestLimitExceeded": TRANSIENT,
    "AccessDenied": DENIED,
    "InvalidAccessKeyId": DENIED,
    "SignatureDoesNotMatch": DENIED,
    "ExpiredToken": DENIED,
    "AllAccessDisabled": DENIED,
    "NoSuchBucket": NOT_FOUND,
    "NoSuchKey": NOT_FOUND,
    "NoSuchUpload": TRANSIENT,
    "QuotaExceeded": FULL,
    "EntityTooLarge": FULL,
}
# connection-level failures by class name (botocore, aiohttp, urllib3), so this module imports none of them
_TRANSIENT_NAMES = (
    "Timeout",
    "ConnectionError",
    "ConnectionClosed",
    "EndpointConnection",
    "Disconnected",
    "ClientConnector",
    "ClientPayload",
    "ClientOSError",
    "IncompleteRead",
    "ProtocolError",
    "ResponseStreamingError",
)


class StorageFault(StoreError):
    """A classified storage failure; an upload answers its `status` (507 when full, 503 + Retry-After when it
    may pass, 500 else)."""

    def __init__(self, kind: str, op: str = "storage", *, retry_after_s: int = 30):
        self.kind, self.op = kind, op
        super().__init__(f"{SENTENCES[kind]} while {op}.")
        self.code = CODES[kind]
        self.status = 507 if kind == FULL else 503 if kind == TRANSIENT else 500
        self.headers = {"Retry-After": str(retry_after_s)} if kind in RETRYABLE else {}

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE

    def detail(self, then: str) -> str:
        """A job's `status_detail` while it waits: "storage_full: finalizing will retry"."""
        return f"{self.code}: {then}"


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


_NOT_STORAGE = ("sqlalchemy", "psycopg", "psycopg2", "redis", "kombu", "celery")  # the database's or broker's


def s3_kind(code: str, status: int) -> str:
    """The kind of an S3 error answer, by its error code or else its HTTP status."""
    if code in _S3_CODES:
        return _S3_CODES[code]
    return TRANSIENT if status >= 500 or status == 429 else PERMANENT


def classify(exc: BaseException) -> str | None:
    """The kind of storage failure `exc` is (or was caused by); None when it is not one."""
    if any(type(link).__module__.split(".")[0] in _NOT_STORAGE for link in _chain(exc)):
        return None
    for link in _chain(exc):
        if isinstance(link, StorageFault):
            return link.kind
        response = getattr(link, "response", None)
        if isinstance(response, dict) and "Error" in response:  # botocore's ClientError
            code = str(response["Error"].get("Code") or "")
            return s3_kind(code, int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0))
        if any(part in cls.__name__ for cls in type(link).__mro__ for part in _TRANSIENT_NAMES):
            return TRANSIENT
    for link in _chain(exc):
        if isinstance(link, OSError) and link.errno in _ERRNO_KINDS:
            return _ERRNO_KINDS[link.errno]
        if isinstance(link, PermissionError):
            return DENIED
        if isinstance(link, FileNotFoundError):
            return NOT_FOUND
        if isinstance(link, (TimeoutError, ConnectionError)):
            return TRANSIENT
    if any(isinstance(link, OSError) for link in _chain(exc)):
        return PERMANENT
    return None


class _Health:
    """This process's storage errors by kind and operation, and the conditions now failing (logged once)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.errors: Counter[tuple[str, str]] = Counter()
        self.failing: dict[str, float] = {}  # kind -> monotonic time it started

    def failed(self, kind: str, op: str, exc: BaseException) -> None:
        with self.lock:
            self.errors[(kind, op)] += 1
            new = kind not in self.failing
            self.failing.setdefault(kind, time.monotonic())
        if new:  # once per condition, not per retry
            log.warning(
                "storage %s (%s) while %s: %s: %s; retrying with backoff, logged again when it recovers",
                CODES[kind],
                kind,
                op,
                type(exc).__name__,
                exc,
            )

    def count(self, kind: str, op: str) -> None:
        with self.lock:
            self.errors[(kind, op)] += 1

    def worked(self) -> None:
        if not self.failing:
            return
        with self.lock:
            kinds, self.failing = dict(self.failing), {}
        for kind, since in kinds.items():
            log.warning("storage recovered from %s after %.0fs", CODES[kind], time.monotonic() - since)

    def snapshot(self) -> tuple[dict[tuple[str, str], int], list[str]]:
        with self.lock:
            return dict(self.errors), sorted(self.failing)


health = _Health()


def storage_fault(exc: BaseException, op: str) -> StorageFault | None:
    """`exc` as a classified StorageFault (counted and logged once per condition); None if not a storage error."""
    if isinstance(exc, StorageFault):
        health.failed(exc.kind, exc.op, exc)
        return exc
    kind = classify(exc)
    if kind is None:
        return None
    health.failed(kind, op, exc)
    fault = StorageFault(kind, op)
    fault.__cause__ = exc
    return fault


T = TypeVar("T")


def retrying(fn: Callable[[], T], op: str, attempts: int = 4, base_s: float = 0.2) -> T:
    """`fn()`, called again with backoff and jitter while it fails transiently; other errors raise at once."""
    for attempt in range(attempts):
        try:
            result = fn()
        except Exception as exc:
            if attempt == attempts - 1 or classify(exc) != TRANSIENT:
                raise
            health.count(TRANSIENT, op)  # counted for the metrics; a retry that passes is no condition to log
            time.sleep(backoff_s(attempt + 1, base_s, base_s * 8))
            continue
        return result  # (reads work on a full disk: only a write's success ends a condition, `health.worked`)
    raise AssertionError("unreachable")


def backoff_s(failures: int, base_s: float, cap_s: float) -> float:
    """Exponential backoff with jitter: between half and all of min(cap, base * 2^(failures-1))."""
    return min(cap_s, base_s * 2 ** max(failures - 1, 0)) * random.uniform(0.5, 1.0)
