"""Files: uploads (held to the size and line limits), the output and error files jobs produce, reads."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import IO

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from batchfile.lines import LineCounter
from store import ids
from store.db import session_scope
from store.errors import Conflict, NotFound, StoreError, TooLarge
from store.filestore.paths import file_key
from store.filestore.storage import get_storage
from store.filestore.storage_faults import health, storage_fault
from store.limits import QuotaExceeded, check_file_quota, check_job_room, upload_room
from store.models import ACTIVE_STATUSES, File, Job, utcnow
from store.pagination import page
from store.settings import Settings


def store_upload(
    settings: Settings,
    chunks: Iterable[bytes],
    *,
    tenant: str,
    filename: str,
    purpose: str = "batch",
    for_job: bool = False,
    expires_after_s: int | None = None,
) -> File:
    """Stream an upload into the storage, enforcing the size and line limits (TooLarge: 413) and the
    tenant's file quota (QuotaExceeded). The quota, and with `for_job` the tenant's active-job limit,
    are checked before anything is written. With `expires_after_s` the file is gone that long after
    its creation (OpenAI's `expires_after`)."""
    room = check_upload_allowed(settings, tenant, for_job=for_job)
    purge_expired(settings, tenant)
    file_id = ids.file_id()
    key = file_key(file_id)
    storage = get_storage(settings.storage_url)
    try:
        with storage.open_write(key) as out:  # on any error nothing is left: no file, no upload
            size, lines, cr_only = _copy_within_limits(settings, chunks, out, room)
        if cr_only:
            lines = _end_lines_with_line_feeds(settings, storage, key)
    except StoreError:
        raise
    except Exception as exc:
        fault = storage_fault(exc, "storing the uploaded file")
        if fault is None:
            raise
        raise fault from exc  # 507 when full, 503 + Retry-After when it may pass: never the raw error
    health.worked()
    now = utcnow()
    record = File(
        id=file_id,
        tenant=tenant,
        purpose=purpose,
        filename=filename or "input.jsonl",
        bytes=size,
        line_count=lines,
        storage_key=key,
        created_at=now,
        expires_at=None if expires_after_s is None else now + timedelta(seconds=expires_after_s),
    )
    try:
        with session_scope(settings.database_url) as s:
            check_file_quota(s, settings, tenant, size)  # again, under the tenant's lock: uploads race
            s.add(record)
    except BaseException:
        storage.delete(key)
        raise
    return record


def check_upload_allowed(settings: Settings, tenant: str, *, for_job: bool = False) -> int | None:
    """Before an upload is read: QuotaExceeded when the tenant's file quota is full, LimitExceeded when
    `for_job` and the tenant is at its active-job limit; returns the quota's bytes left (None: no bound)."""
    with session_scope(settings.database_url) as s:
        if for_job:
            check_job_room(s, settings, tenant)
        return upload_room(s, settings, tenant)


def _copy_within_limits(
    settings: Settings, chunks: Iterable[bytes], out: IO[bytes], room: int | None
) -> tuple[int, int, bool]:
    """Copy the chunks to `out` until a limit is passed; returns (bytes, non-blank lines, whether its lines
    end with carriage returns alone)."""
    size = 0
    counter = LineCounter()
    for chunk in chunks:
        if not chunk:
            continue
        size += len(chunk)
        if size > settings.max_upload_bytes:
            raise TooLarge(f"file exceeds the limit of {settings.max_upload_bytes} bytes")
        if room is not None and size > room:
            raise QuotaExceeded(f"file exceeds the {room} bytes left in the tenant's file quota", param="file")
        if counter.feed(chunk) > settings.max_lines:
            raise _too_many_lines(settings)
        out.write(chunk)
    if counter.finish() > settings.max_lines:
        raise _too_many_lines(settings)
    return size, counter.lines, counter.cr_only


def _end_lines_with_line_feeds(settings: Settings, storage, key: str) -> int:
    """A stored upload whose lines end with carriage returns alone (no line feed anywhere), rewritten
    with line feeds in their place, as universal newlines read it (same size); returns its non-blank
    lines. Past max_lines it is deleted and TooLarge (413)."""
    counter = LineCounter()
    try:
        with storage.open_read(key) as src, storage.open_write(key) as out:
            while chunk := src.read(1 << 20):
                chunk = chunk.replace(b"\r", b"\n")
                if counter.feed(chunk) > settings.max_lines:
                    raise _too_many_lines(settings)
                out.write(chunk)
        if counter.finish() > settings.max_lines:
            raise _too_many_lines(settings)
    except BaseException:
        storage.delete(key)
        raise
    return counter.lines


def _too_many_lines(settings: Settings) -> TooLarge:
    return TooLarge(f"file exceeds the limit of {settings.max_lines} lines (blank lines do not count)")


def register_file(settings: Settings, *, tenant: str, key: str, filename: str, purpose: str) -> File:
    """A file row for a file already written at `key` (a job's output or error file)."""
    record = File(
        id=ids.file_id(),
        tenant=tenant,
        purpose=purpose,
        filename=filename,
        bytes=get_storage(settings.storage_url).size(key),
        storage_key=key,
    )
    with session_scope(settings.database_url) as s:
        s.add(record)
    return record


def set_output_expiry(session: Session, job: Job) -> None:
    """Give the job's output and error files the expiry its batch asked for (output_expires_after)."""
    if job.output_expires_after_s is None:
        return
    for file_id in (job.output_file_id, job.error_file_id):
        record = session.get(File, file_id) if file_id else None
        if record is not None:
            record.expires_at = record.created_at + timedelta(seconds=job.output_expires_after_s)


def get_file(settings: Settings, tenant: str, file_id: str) -> File:
    """The tenant's file; a deleted or expired file is not found (an expired one is deleted now)."""
    with session_scope(settings.database_url) as s:
        record = s.get(File, file_id)
        if record is None or record.tenant != tenant or record.deleted_at is not None:
            raise NotFound(f"No such file: {file_id}", param="file_id")
    if record.expires_at is not None and record.expires_at <= utcnow():
        _delete(settings, record.id)
        raise NotFound(f"No such file: {file_id} (it expired)", param="file_id")
    return record


def delete_file(settings: Settings, tenant: str, file_id: str) -> File:
    """Delete the tenant's file: its content goes at once, its row stays (jobs refer to it) but no
    read finds it again. A file that is the input of an unfinished job is a Conflict."""
    record = get_file(settings, tenant, file_id)
    with session_scope(settings.database_url) as s:
        user = s.scalar(select(Job.id).where(Job.input_file_id == file_id, Job.status.in_(ACTIVE_STATUSES)).limit(1))
    if user is not None:
        raise Conflict(f"file {file_id} is the input of batch {user}, which has not finished", param="file_id")
    _delete(settings, record.id)
    return record


def purge_expired(settings: Settings, tenant: str, limit: int = 100) -> int:
    """Delete up to `limit` of the tenant's expired files (their content goes now; reads already skip
    them). Run at each upload, so expired files do not hold storage while their tenant keeps working."""
    with session_scope(settings.database_url) as s:
        expired = list(
            s.scalars(
                select(File.id)
                .where(File.tenant == tenant, File.deleted_at.is_(None), File.expires_at <= utcnow())
                .limit(limit)
            )
        )
    for file_id in expired:
        _delete(settings, file_id)
    return len(expired)


def _delete(settings: Settings, file_id: str) -> None:
    with session_scope(settings.database_url) as s:
        record = s.get(File, file_id, with_for_update=True)
        if record is None or record.deleted_at is not None:
            return
        record.deleted_at = utcnow()
        key = record.storage_key
    get_storage(settings.storage_url).delete(key)


def list_files(
    settings: Settings,
    tenant: str,
    *,
    purpose: str | None = None,
    limit: int = 10_000,
    after: str | None = None,
    ascending: bool = False,
) -> tuple[list[File], bool]:
    """Newest first (oldest first when `ascending`); `after` is the id of the last file of the previous
    page. Deleted and expired files are left out."""
    with session_scope(settings.database_url) as s:
        query = select(File).where(
            File.tenant == tenant,
            File.deleted_at.is_(None),
            or_(File.expires_at.is_(None), File.expires_at > utcnow()),
        )
        if purpose:
            query = query.where(File.purpose == purpose)
        return page(s, File, query, tenant, limit, after, "file", ascending=ascending)
