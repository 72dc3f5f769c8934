"""Files: uploads (held to the size and line limits), the output and error files jobs produce, reads."""

from __future__ import annotations

from collections.abc import Iterable
from typing import IO

from sqlalchemy import select

from store import ids
from store.db import session_scope
from store.errors import NotFound, TooLarge
from store.models import File
from store.pagination import page
from store.paths import file_key
from store.settings import Settings
from store.storage import get_storage


def store_upload(
    settings: Settings,
    chunks: Iterable[bytes],
    *,
    tenant: str,
    filename: str,
    purpose: str = "batch",
) -> File:
    """Stream an upload into the storage, enforcing the size and line limits (TooLarge: 413)."""
    file_id = ids.file_id()
    key = file_key(file_id)
    storage = get_storage(settings.storage_url)
    with storage.open_write(key) as out:
        size, lines, ends_with_newline = _copy_within_limits(settings, chunks, out)
    if not ends_with_newline:  # the last line has no line break but is a line
        lines += 1
        if lines > settings.max_lines:
            storage.delete(key)
            raise _too_many_lines(settings)
    record = File(
        id=file_id,
        tenant=tenant,
        purpose=purpose,
        filename=filename or "input.jsonl",
        bytes=size,
        line_count=lines,
        storage_key=key,
    )
    with session_scope(settings.database_url) as s:
        s.add(record)
    return record


def _copy_within_limits(settings: Settings, chunks: Iterable[bytes], out: IO[bytes]) -> tuple[int, int, bool]:
    """Copy the chunks to `out` until a limit is passed; returns (bytes, line breaks, ends with one)."""
    size = lines = 0
    last = b"\n"
    for chunk in chunks:
        if not chunk:
            continue
        size += len(chunk)
        if size > settings.max_upload_bytes:
            raise TooLarge(f"file exceeds the limit of {settings.max_upload_bytes} bytes")
        lines += chunk.count(b"\n")
        if lines > settings.max_lines:
            raise _too_many_lines(settings)
        last = chunk[-1:]
        out.write(chunk)
    return size, lines, last == b"\n"


def _too_many_lines(settings: Settings) -> TooLarge:
    return TooLarge(f"file exceeds the limit of {settings.max_lines} lines")


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


def get_file(settings: Settings, tenant: str, file_id: str) -> File:
    with session_scope(settings.database_url) as s:
        record = s.get(File, file_id)
        if record is None or record.tenant != tenant:
            raise NotFound(f"No such file: {file_id}", param="file_id")
        return record


def list_files(
    settings: Settings, tenant: str, *, purpose: str | None = None, limit: int = 100, after: str | None = None
) -> tuple[list[File], bool]:
    """Newest first; `after` is the id of the last file of the previous page."""
    with session_scope(settings.database_url) as s:
        query = select(File).where(File.tenant == tenant)
        if purpose:
            query = query.where(File.purpose == purpose)
        return page(s, File, query, tenant, limit, after, "file")
