"""What operators see of the storage: the readiness check's verdict and the Prometheus series.

`check_storage` writes and removes a small probe file (cached for `PROBE_TTL_S`, so a busy readiness
endpoint does not hammer the storage) and, for local storage, compares the free bytes with
`storage_min_free_bytes`, and reports the S3 client retrying a sustained share of its calls
(`store.filestore.storage_retries`). `StorageCollector` exports this process's storage errors by kind and operation
(`store.filestore.storage_faults`), the conditions failing now, and local storage's free bytes.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from store.filestore import storage_retries
from store.filestore.storage import get_storage, is_local
from store.filestore.storage_faults import KINDS, health, storage_fault
from store.settings import Settings

PROBE_TTL_S = 2.0
_probes: dict[str, tuple[float, dict]] = {}  # storage url -> (monotonic time, last verdict); one per storage
_lock = threading.Lock()


def free_bytes(settings: Settings) -> int | None:
    """Free bytes of local storage (None for an object store, which has no such number)."""
    storage = get_storage(settings.storage_url)
    if not is_local(storage.fs):
        return None
    try:
        return shutil.disk_usage(storage.root).free
    except OSError:
        return None


def _probe(settings: Settings) -> str | None:
    """None when a small file can be written, read back and removed; else why not (a code and sentence)."""
    storage = get_storage(settings.storage_url)
    key = f"health/probe-{uuid.uuid4().hex}"
    try:
        with storage.open_write(key) as f:
            f.write(b"ok\n")
        storage.delete(key)
    except Exception as exc:  # reported, not raised
        fault = storage_fault(exc, "writing the readiness probe")
        return f"{fault.code}: {fault.message}" if fault else f"storage_unavailable: {type(exc).__name__}"
    health.worked()
    return None


def check_storage(settings: Settings) -> dict:
    """{"status": "ok" | "degraded", "writable", "free_bytes", "min_free_bytes", "reasons"}."""
    with _lock:
        cached = _probes.get(settings.storage_url)
    if cached is not None and time.monotonic() - cached[0] < PROBE_TTL_S:
        return cached[1]
    reasons = []
    error = _probe(settings)
    if error:
        reasons.append(error)
    free = free_bytes(settings)
    if free is not None and free < settings.storage_min_free_bytes:
        reasons.append(f"storage_low: {free} bytes free, under the {settings.storage_min_free_bytes} configured")
    retrying = storage_retries.recent.retrying()  # calls that passed, but only after the client retried them
    if retrying:
        reasons.append(retrying)
    verdict = {
        "status": "degraded" if reasons else "ok",
        "writable": error is None,
        "free_bytes": free,
        "min_free_bytes": settings.storage_min_free_bytes if free is not None else None,
        "reasons": reasons,
    }
    with _lock:
        _probes[settings.storage_url] = (time.monotonic(), verdict)
    return verdict


class StorageCollector:
    """This process's storage errors and failing conditions, and local storage's free bytes, when scraped."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def collect(self):
        counts, failing = health.snapshot()
        errors = CounterMetricFamily(
            "pagedbatch_storage_errors",
            "Storage operations that failed in this process, by kind and operation",
            labels=["kind", "op"],
        )
        for (kind, op), count in sorted(counts.items()):
            errors.add_metric([kind, op], count)
        yield errors
        degraded = GaugeMetricFamily(
            "pagedbatch_storage_failing", "1 while this process sees the storage failing this way", labels=["kind"]
        )
        for kind in KINDS:
            degraded.add_metric([kind], 1.0 if kind in failing else 0.0)
        yield degraded
        yield GaugeMetricFamily(
            "pagedbatch_storage_retrying",
            f"1 while a sustained share of this process's S3 calls fails and is retried by the client "
            f"(the last {storage_retries.WINDOW_S}s)",
            value=1.0 if storage_retries.recent.retrying() else 0.0,
        )
        free = free_bytes(self.settings)
        if free is not None:
            yield GaugeMetricFamily("pagedbatch_storage_free_bytes", "Free bytes of the local storage", value=free)
