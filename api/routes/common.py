"""Helpers shared by the blueprints: the platform object, uploads, pagination, streaming files."""

from __future__ import annotations

import json
import math
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator

from flask import Request, Response, current_app, request

from api.errors import ApiError
from store.settings import Settings
from store.storage import get_storage

CHUNK = 1 << 20
UPLOAD_CHUNK = 1 << 16  # uploads are read this much at a time, so a limit cuts them off within 64 KiB


class TerminalCache:
    """Bodies of finished jobs, which never change again, so pollers of a finished job skip the database."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


finished_bodies = TerminalCache()


def cached_job_body(kind: str, tenant: str, job_id: str, shape) -> dict:
    """`shape(job, progress)` for the tenant's job, read in one transaction, and served from
    `finished_bodies` once the job has finished."""
    from store import lifecycle
    from store.models import TERMINAL_STATUSES

    key = (kind, settings().database_url, tenant, job_id)
    body = finished_bodies.get(key)
    if body is None:
        job, progress = lifecycle.get_job_and_progress(settings(), tenant, job_id)
        body = shape(job, progress)
        if job.status in TERMINAL_STATUSES:
            finished_bodies.put(key, body)
    return body


def settings() -> Settings:
    return current_app.extensions["pagedbatch"].settings


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
        super().__init__(max_size=512 * 1024, mode="w+b")
        self.max_bytes, self.max_lines = max_bytes, max_lines
        self.written = self.line_breaks = 0

    def write(self, data) -> int:
        from store.lifecycle import TooLarge

        self.written += len(data)
        if self.written > self.max_bytes:
            raise TooLarge(f"file exceeds the limit of {self.max_bytes} bytes")
        self.line_breaks += bytes(data).count(b"\n")
        if self.line_breaks > self.max_lines:
            raise TooLarge(f"file exceeds the limit of {self.max_lines} lines")
        return super().write(data)


class UploadRequest(Request):
    """Flask's request, with multipart file parts held to the upload limits while they stream in."""

    def _get_file_stream(self, total_content_length, content_type, filename=None, content_length=None):
        cfg = current_app.extensions["pagedbatch"].settings
        return _LimitedSpool(cfg.max_upload_bytes, cfg.max_lines)


def check_content_length() -> None:
    limit = settings().max_upload_bytes
    if request.content_length is not None and request.content_length > limit + CHUNK:
        raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="payload_too_large")


MAX_PARAM_DEPTH = 32  # nesting of a JSON parameter (defaults); deeper is a 400, never a RecursionError
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's metadata limits


def parse_json(text, what: str, param: str | None = None):
    """JSON text (str or bytes) as a 400 when it is not JSON, however deeply it nests."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ApiError(400, f"{what} is not valid JSON: {str(exc)[:200]}", param=param) from None


def _check_json_value(value, name: str) -> None:
    """No nesting past MAX_PARAM_DEPTH, no NUL characters and no NaN or infinities (jsonb refuses them)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_PARAM_DEPTH:
            raise ApiError(400, f"{name} nests deeper than {MAX_PARAM_DEPTH} levels", param=name)
        if isinstance(item, dict):
            stack.extend((k, depth) for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str) and "\x00" in item:
            raise ApiError(400, f"{name} must not contain NUL characters", param=name)
        elif isinstance(item, float) and not math.isfinite(item):  # NaN, Infinity, 1e999: not JSON
            raise ApiError(400, f"{name} must hold finite numbers only", param=name)


def json_param(value, name: str) -> dict | None:
    """A JSON object given as a form field or query argument (a string) or inline in a JSON body."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        value = parse_json(value, name, name)
    if not isinstance(value, dict):
        raise ApiError(400, f"{name} must be a JSON object", param=name)
    _check_json_value(value, name)
    return value


def metadata_param(value) -> dict | None:
    """OpenAI's metadata: at most 16 pairs of strings, keys up to 64 and values up to 512 characters."""
    metadata = json_param(value, "metadata")
    if metadata is None:
        return None
    if len(metadata) > METADATA_PAIRS:
        raise ApiError(400, f"metadata holds at most {METADATA_PAIRS} pairs", param="metadata")
    for key, item in metadata.items():
        if not isinstance(item, str):
            raise ApiError(400, f"metadata[{key!r:.70}] must be a string", param="metadata")
        if len(key) > METADATA_KEY_CHARS or len(item) > METADATA_VALUE_CHARS:
            raise ApiError(
                400,
                f"metadata keys are at most {METADATA_KEY_CHARS} and values at most "
                f"{METADATA_VALUE_CHARS} characters",
                param="metadata",
            )
    return metadata


def reject_nul_bytes() -> None:
    """A NUL in a path id or query argument is a 400: PostgreSQL text cannot hold one."""
    for name, value in [*(request.view_args or {}).items(), *request.args.items(multi=True)]:
        if isinstance(value, str) and "\x00" in value:
            raise ApiError(400, f"{name} must not contain NUL characters", param=name)


def upload_filename(upload) -> str:
    """The multipart filename, without control characters, cut to what the files table holds."""
    name = "".join(ch for ch in upload.filename or "" if ch.isprintable())[:255].strip()
    return name or "input.jsonl"


def limit_param(default: int = 20, maximum: int = 100) -> int:
    raw = request.args.get("limit", default)
    try:
        limit = int(raw)
    except (TypeError, ValueError):
        raise ApiError(400, "limit must be an integer", param="limit") from None
    if not 1 <= limit <= maximum:
        raise ApiError(400, f"limit must be between 1 and {maximum}", param="limit")
    return limit


def list_body(items: list[dict], has_more: bool) -> dict:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }


def send_fs(fs, path: str, mimetype: str, download_name: str) -> Response:
    """Stream a file of an fsspec filesystem."""
    if not fs.exists(path):
        raise ApiError(404, "the file's content is not available", code="not_found")
    size = fs.size(path)

    def generate():
        with fs.open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk

    response = Response(generate(), mimetype=mimetype)
    response.headers["Content-Length"] = str(size)
    response.headers["Content-Disposition"] = f'attachment; filename="{download_name}"'
    return response


def send_stored(key: str, mimetype: str, download_name: str) -> Response:
    storage = get_storage(settings().storage_url)
    return send_fs(storage.fs, storage.path(key), mimetype, download_name)


def send_lines(lines: Iterator[str], download_name: str) -> Response:
    response = Response((line.encode() for line in lines), mimetype="application/x-ndjson")
    response.headers["Content-Disposition"] = f'attachment; filename="{download_name}"'
    return response
