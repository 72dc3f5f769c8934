"""Files uploaded in parts (OpenAI's Uploads API): create, add parts, complete (or cancel), expire.

Each part streams straight into the storage (`uploads/<upload id>/<part id>`) under the part and upload
limits, so memory stays bounded however big the file. `complete` joins the parts in the order it is given
through `store.filestore.files.store_upload`, so the file is held to the same size, line and quota limits as a
/v1/files upload and is a normal batch input; with `md5` the joined bytes are checked before the file
appears. A part whose request broke off is never recorded: the client sends it again (resume). Uploads
not completed by their `expires_at` expire and their parts are deleted (`expire_uploads`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from datetime import timedelta

from sqlalchemy import func, select

from store import ids
from store.db import session_scope
from store.errors import Conflict, NotFound, StoreError, TooLarge
from store.filestore.files import check_upload_allowed, store_upload
from store.filestore.storage import get_storage
from store.filestore.storage_faults import health, storage_fault
from store.limits import QuotaExceeded
from store.models import (
    UPLOAD_CANCELLED,
    UPLOAD_COMPLETED,
    UPLOAD_EXPIRED,
    UPLOAD_PENDING,
    File,
    Upload,
    UploadPart,
    utcnow,
)
from store.pagination import page
from store.settings import Settings

BATCH_MIME_TYPES = ("application/jsonl", "application/x-ndjson", "application/json", "text/jsonl", "text/plain")
READ_CHUNK = 1 << 20


def upload_id() -> str:
    return ids.new_id("upload_")


def part_key(upload: str, part: str) -> str:
    return f"uploads/{upload}/{part}"


def create_upload(settings: Settings, *, tenant: str, filename: str, purpose: str, size: int, mime_type: str) -> Upload:
    """A pending upload of `size` bytes; TooLarge past max_upload_bytes, QuotaExceeded when the tenant's file
    quota has no room for it."""
    if purpose != "batch":
        raise StoreError("only purpose 'batch' is supported", param="purpose")
    if mime_type not in BATCH_MIME_TYPES:
        raise StoreError(f"mime_type must be one of {', '.join(BATCH_MIME_TYPES)} for purpose 'batch'",
                         param="mime_type")  # fmt: skip
    if size > settings.max_upload_bytes:  # the maximum the OpenAPI document publishes: a bad parameter
        raise StoreError(f"bytes exceeds the limit of {settings.max_upload_bytes} bytes", param="bytes")
    room = check_upload_allowed(settings, tenant)
    if room is not None and size > room:
        raise QuotaExceeded(f"bytes exceeds the {room} bytes left in the tenant's file quota", param="bytes")
    expire_uploads(settings, tenant=tenant)
    now = utcnow()
    upload = Upload(
        id=upload_id(), tenant=tenant, filename=filename, purpose=purpose, mime_type=mime_type, bytes=size,
        status=UPLOAD_PENDING, created_at=now, expires_at=now + timedelta(seconds=settings.upload_expires_s),
    )  # fmt: skip
    with session_scope(settings.database_url) as s:
        s.add(upload)
    return upload


def get_upload(settings: Settings, tenant: str, upload: str) -> tuple[Upload, File | None]:
    """The tenant's upload (an overdue pending one expired now) and, once completed, its file."""
    with session_scope(settings.database_url) as s:
        record = s.get(Upload, upload)
        if record is None or record.tenant != tenant:
            raise NotFound(f"No such upload: {upload}", param="upload_id")
    with session_scope(settings.database_url) as s:
        if record.status == UPLOAD_PENDING and record.expires_at <= utcnow():
            expire_uploads(settings, tenant=tenant)  # (one being completed right now is left to complete)
            record = s.get(Upload, upload)
        return record, s.get(File, record.file_id) if record.file_id else None


def list_uploads(settings: Settings, tenant: str, *, limit: int = 20, after: str | None = None):
    """The tenant's uploads, newest first, with their files: (pairs, whether more follow)."""
    with session_scope(settings.database_url) as s:
        records, more = page(s, Upload, select(Upload).where(Upload.tenant == tenant), tenant, limit, after, "upload")
        return [(r, s.get(File, r.file_id) if r.file_id else None) for r in records], more


def _pending(settings: Settings, tenant: str, upload: str) -> Upload:
    record, _ = get_upload(settings, tenant, upload)
    if record.status != UPLOAD_PENDING:
        raise Conflict(f"upload {upload} is {record.status}; only a pending upload takes parts", param="upload_id")
    return record


def _stored_bytes(session, upload: str) -> tuple[int, int]:
    count, total = session.execute(
        select(func.count(UploadPart.id), func.coalesce(func.sum(UploadPart.bytes), 0)).where(
            UploadPart.upload_id == upload
        )
    ).one()
    return int(count), int(total)


def add_part(settings: Settings, tenant: str, upload: str, chunks: Iterable[bytes]) -> UploadPart:
    """Stream one part into the storage. TooLarge past max_upload_part_bytes; Conflict past the upload's bytes
    (with the parts already stored) or max_upload_parts. A failed part leaves nothing behind."""
    record = _pending(settings, tenant, upload)
    with session_scope(settings.database_url) as s:
        count, total = _stored_bytes(s, upload)
    if count >= settings.max_upload_parts:
        raise Conflict(f"upload {upload} already has the most parts allowed ({settings.max_upload_parts})")
    room = record.bytes - total
    part = UploadPart(id=ids.new_id("part_"), upload_id=upload, bytes=0, created_at=utcnow())
    part.storage_key = part_key(upload, part.id)
    storage = get_storage(settings.storage_url)
    try:
        with storage.open_write(part.storage_key) as out:  # nothing appears unless the whole part arrived
            for chunk in chunks:
                part.bytes += len(chunk)
                if part.bytes > settings.max_upload_part_bytes:
                    raise TooLarge(f"part exceeds the limit of {settings.max_upload_part_bytes} bytes a part")
                if part.bytes > room:
                    raise _past_the_end(record, total)
                out.write(chunk)
    except StoreError:
        raise
    except Exception as exc:
        fault = storage_fault(exc, "storing an upload part")
        if fault is None:
            raise
        raise fault from exc
    health.worked()
    try:
        with session_scope(settings.database_url) as s:
            locked = s.get(Upload, upload, with_for_update=True)  # parts of one upload race
            count, total = _stored_bytes(s, upload)
            if locked.status != UPLOAD_PENDING:
                raise Conflict(f"upload {upload} is {locked.status}", param="upload_id")
            if count >= settings.max_upload_parts:
                raise Conflict(f"upload {upload} already has the most parts allowed ({settings.max_upload_parts})")
            if total + part.bytes > record.bytes:
                raise _past_the_end(record, total)
            s.add(part)
    except BaseException:
        storage.delete(part.storage_key)
        raise
    return part


def _past_the_end(record: Upload, stored: int) -> Conflict:
    return Conflict(f"part goes past the upload's {record.bytes} bytes ({stored} bytes are already uploaded)",
                    param="data")  # fmt: skip


def complete_upload(
    settings: Settings, tenant: str, upload: str, part_ids: list[str], md5: str | None = None
) -> tuple[Upload, File]:
    """Join the parts in `part_ids`' order into a batch input file (checked as a /v1/files upload is); the
    upload is completed and its parts deleted. The parts must hold exactly the upload's bytes."""
    _pending(settings, tenant, upload)
    if len(set(part_ids)) != len(part_ids):
        raise StoreError("part_ids names a part twice", param="part_ids")
    with session_scope(settings.database_url) as s:
        locked = s.get(Upload, upload, with_for_update=True)  # one complete at a time; parts wait for it
        if locked.status != UPLOAD_PENDING:
            raise Conflict(f"upload {upload} is {locked.status}", param="upload_id")
        parts = {p.id: p for p in s.scalars(select(UploadPart).where(UploadPart.upload_id == upload))}
        unknown = [p for p in part_ids if p not in parts]
        if unknown:
            raise Conflict(f"upload {upload} has no part {', '.join(unknown[:5])}", param="part_ids")
        keys = [parts[p].storage_key for p in part_ids]
        size = sum(parts[p].bytes for p in part_ids)
        if size != locked.bytes:
            raise Conflict(f"the parts hold {size} bytes; the upload was created for {locked.bytes}",
                           param="part_ids")  # fmt: skip
        record = store_upload(settings, _joined(settings, keys, md5), tenant=tenant, filename=locked.filename,
                              purpose=locked.purpose)  # fmt: skip
        locked.status, locked.file_id = UPLOAD_COMPLETED, record.id
    _delete_parts(settings, upload)
    return locked, record


def _joined(settings: Settings, keys: list[str], md5: str | None) -> Iterator[bytes]:
    """The parts' bytes in order; with `md5`, a mismatch raises after the last byte (so no file appears)."""
    storage = get_storage(settings.storage_url)
    digest = hashlib.md5(usedforsecurity=False)
    for key in keys:
        with storage.open_read(key) as f:
            while chunk := f.read(READ_CHUNK):
                digest.update(chunk)
                yield chunk
    if md5 and digest.hexdigest() != md5.strip().lower():
        raise Conflict(f"md5 mismatch: the parts' md5 is {digest.hexdigest()}, not {md5}", param="md5")


def cancel_upload(settings: Settings, tenant: str, upload: str) -> Upload:
    """A pending upload cancelled: no part can be added, and the stored parts are deleted."""
    _pending(settings, tenant, upload)
    with session_scope(settings.database_url) as s:
        locked = s.get(Upload, upload, with_for_update=True)
        if locked.status != UPLOAD_PENDING:
            raise Conflict(f"upload {upload} is {locked.status}", param="upload_id")
        locked.status = UPLOAD_CANCELLED
    _delete_parts(settings, upload)
    return locked


def expire_uploads(settings: Settings, *, tenant: str | None = None, limit: int = 100) -> int:
    """Pending uploads past their `expires_at` marked expired and their parts deleted; returns how many."""
    with session_scope(settings.database_url) as s:
        query = select(Upload).where(Upload.status == UPLOAD_PENDING, Upload.expires_at <= utcnow())
        if tenant is not None:
            query = query.where(Upload.tenant == tenant)
        overdue = list(s.scalars(query.limit(limit).with_for_update(skip_locked=True)))
        for record in overdue:
            record.status = UPLOAD_EXPIRED
        expired = [record.id for record in overdue]
    for upload in expired:
        _delete_parts(settings, upload)
    return len(expired)


def _delete_parts(settings: Settings, upload: str) -> None:
    """The upload's stored parts deleted (their rows go too)."""
    storage = get_storage(settings.storage_url)
    with session_scope(settings.database_url) as s:
        parts = list(s.scalars(select(UploadPart).where(UploadPart.upload_id == upload)))
        for part in parts:
            s.delete(part)
        keys = [part.storage_key for part in parts]
    for key in keys:
        storage.delete(key)
    storage.delete(f"uploads/{upload}")
