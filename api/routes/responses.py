"""What the routes send: API objects as JSON, finished jobs' bodies from a cache, and stored files
streamed in chunks."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from urllib.parse import quote

from flask import Response, jsonify

from api.errors import ApiError
from api.objects import ApiObject
from api.platform import settings
from store.filestore.storage import get_storage
from store.lifecycle.progress import Progress, get_job_and_progress
from store.models import TERMINAL_STATUSES, Job

READ_CHUNK = 1 << 20


def send_object(obj: ApiObject, status: int = 200) -> tuple[Response, int]:
    """An API object (api.objects) as the JSON response."""
    return jsonify(obj.model_dump(mode="json")), status


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


def cached_job_body(kind: str, tenant: str, job_id: str, shape: Callable[[Job, Progress], ApiObject]) -> dict:
    """`shape(job, progress)` for the tenant's job, read in one transaction, as JSON-ready data, and
    served from `finished_bodies` once the job has finished."""
    key = (kind, settings().database_url, tenant, job_id)
    body = finished_bodies.get(key)
    if body is None:
        job, progress = get_job_and_progress(settings(), tenant, job_id)
        body = shape(job, progress).model_dump(mode="json")
        if job.status in TERMINAL_STATUSES:
            finished_bodies.put(key, body)
    return body


def send_fs(fs, path: str, mimetype: str, download_name: str) -> Response:
    """Stream a file of an fsspec filesystem."""
    if not fs.exists(path):
        raise ApiError(404, "the file's content is not available", code="not_found")
    size = fs.size(path)

    def generate():
        with fs.open(path, "rb") as f:
            while chunk := f.read(READ_CHUNK):
                yield chunk

    response = Response(generate(), mimetype=mimetype)
    response.headers["Content-Length"] = str(size)
    response.headers["Content-Disposition"] = content_disposition(download_name)
    return response


def content_disposition(filename: str) -> str:
    """RFC 6266 `attachment` with the name as a quoted ASCII `filename` (other characters as "_", no
    quote, backslash or control character, so it cannot end the string and add parameters) and, when
    that is not the name itself, the exact name as RFC 8187 `filename*=UTF-8''<percent-encoded>`.
    The header stays ASCII, so every server can send it."""
    fallback = "".join(ch if " " <= ch <= "~" and ch not in '";\\' else "_" for ch in filename) or "download"
    header = f'attachment; filename="{fallback}"'
    if fallback != filename:
        header += "; filename*=UTF-8''" + quote(filename, safe="")
    return header


def send_stored(key: str, mimetype: str, download_name: str) -> Response:
    storage = get_storage(settings().storage_url)
    return send_fs(storage.fs, storage.path(key), mimetype, download_name)


def send_lines(lines: Iterator[str], download_name: str) -> Response:
    response = Response((line.encode() for line in lines), mimetype="application/x-ndjson")
    response.headers["Content-Disposition"] = content_disposition(download_name)
    return response
