"""Helpers shared by the blueprints: the platform object, uploads, pagination, streaming files."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterator

from flask import Response, current_app, request

from api.errors import ApiError
from api.store.settings import Settings
from api.store.storage import get_storage

CHUNK = 1 << 20


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


def cached_job_body(kind: str, tenant: str, job_id: str, build) -> dict:
    """`build(job)` for the tenant's job, served from `finished_bodies` once the job has finished."""
    from api.store import lifecycle
    from api.store.models import TERMINAL_STATUSES

    key = (kind, settings().database_url, tenant, job_id)
    body = finished_bodies.get(key)
    if body is None:
        job = lifecycle.get_job(settings(), tenant, job_id)
        body = build(job)
        if job.status in TERMINAL_STATUSES:
            finished_bodies.put(key, body)
    return body


def settings() -> Settings:
    return current_app.extensions["pagedbatch"].settings


def upload_chunks(stream) -> Iterator[bytes]:
    while True:
        chunk = stream.read(CHUNK)
        if not chunk:
            return
        yield chunk


def check_content_length() -> None:
    limit = settings().max_upload_bytes
    if request.content_length is not None and request.content_length > limit + CHUNK:
        raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="payload_too_large")


def json_param(value, name: str) -> dict | None:
    """A JSON object given as a form field or query argument (a string) or inline in a JSON body."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"{name} must be a JSON object: {exc}", param=name) from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{name} must be a JSON object", param=name)
    return value


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
