"""Uploads held to the limits while they stream in: a 413 as soon as a file passes max_upload_bytes or
max_lines, never after the whole body has been read."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

from flask import Request, request

from api.errors import ApiError
from api.platform import settings
from batchfile.lines import LineCounter
from store.errors import TooLarge

UPLOAD_CHUNK = 1 << 16  # uploads are read this much at a time, so a limit cuts them off within 64 KiB
FRAMING_ROOM = 1 << 20  # what a request body may hold beyond max_upload_bytes: multipart framing, fields
SPOOL_IN_MEMORY = 512 * 1024  # a multipart file part this small stays in memory


def upload_chunks(stream) -> Iterator[bytes]:
    """The upload in small chunks; past max_upload_bytes nothing more is read (store_upload answers 413)."""
    left = settings().max_upload_bytes + 1
    while left > 0:
        chunk = stream.read(min(UPLOAD_CHUNK, left))
        if not chunk:
            return
        left -= len(chunk)
        yield chunk


class _LimitedSpool(tempfile.SpooledTemporaryFile):
    """Where the multipart parser writes an uploaded file as it reads it: a 413 the moment the file
    passes the byte or line limit, rather than after the whole body has been spooled."""

    def __init__(self, max_bytes: int, max_lines: int):
        super().__init__(max_size=SPOOL_IN_MEMORY, mode="w+b")
        self.max_bytes, self.max_lines = max_bytes, max_lines
        self.written = 0
        self.lines = LineCounter()  # non-blank lines: blank ones do not count

    def write(self, data) -> int:
        self.written += len(data)
        if self.written > self.max_bytes:
            raise TooLarge(f"file exceeds the limit of {self.max_bytes} bytes")
        if self.lines.feed(bytes(data)) > self.max_lines:
            raise TooLarge(f"file exceeds the limit of {self.max_lines} lines")
        return super().write(data)


class UploadRequest(Request):
    """Flask's request, with multipart file parts held to the upload limits while they stream in."""

    def _get_file_stream(self, total_content_length, content_type, filename=None, content_length=None):
        cfg = settings()
        return _LimitedSpool(cfg.max_upload_bytes, cfg.max_lines)


def check_content_length() -> None:
    """A 413 before reading a body that declares more than any upload may hold."""
    limit = settings().max_upload_bytes
    if request.content_length is not None and request.content_length > limit + FRAMING_ROOM:
        raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="payload_too_large")


def upload_filename(upload) -> str:
    """The multipart filename, without control characters, cut to what the files table holds."""
    name = "".join(ch for ch in upload.filename or "" if ch.isprintable())[:255].strip()
    return name or "input.jsonl"
