"""Uploads over the byte or line limit are cut off while they stream: the server answers 413 having
read little more than the limit, and never holds the body in memory.

The request body is a stream that could produce ten times the limit and counts what the server reads;
the request goes straight through WSGI (no test client buffering it first).
"""

import dataclasses
import io
import json

import pytest
from werkzeug.test import EnvironBuilder, run_wsgi_app

from tests.helpers import MODEL
from tests.traced import traced_in_child

LIMIT = 1 << 20  # max_upload_bytes in these tests
SLACK = 1 << 17  # how far past a limit the server may read: a read chunk or two of multipart framing
LINE = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "y"}}).encode()
BOUNDARY = "pagedbatch-boundary"


class CountingBody(io.RawIOBase):
    """`head` and then `LINE`s until `total` bytes; `served` is how many bytes were read."""

    def __init__(self, total: int, head: bytes = b""):
        self.total, self.head, self.served = total, head, 0
        self.lines = LINE + b"\n"

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.total - self.served)
        if n <= 0:
            return 0
        start = self.served
        out = bytearray()
        if start < len(self.head):
            out += self.head[start : start + n]
        offset = max(0, start - len(self.head))  # position within the repeated lines
        while len(out) < n:
            i = offset % len(self.lines)
            piece = self.lines[i : i + n - len(out)]
            out += piece
            offset += len(piece)
        buffer[:n] = out
        self.served += n
        return n


def _multipart_head(path: str) -> bytes:
    fields = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{"purpose" if path == "/v1/files" else "model"}"'
    value = "batch" if path == "/v1/files" else MODEL
    return (
        f"{fields}\r\n\r\n{value}\r\n--{BOUNDARY}\r\n"
        'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()


def _post(app, path: str, content_type: str, body: CountingBody, headers: dict, content_length: int | None = None):
    environ = EnvironBuilder(path=path, method="POST", headers=headers).get_environ()
    environ["CONTENT_TYPE"] = content_type  # set here: EnvironBuilder puts its own multipart boundary in
    environ["wsgi.input"] = body
    environ.pop("CONTENT_LENGTH", None)
    if content_length is None:
        environ["wsgi.input_terminated"] = True  # chunked: the server learns the size only by reading
    else:
        environ["CONTENT_LENGTH"] = str(content_length)
    app_iter, status, _ = run_wsgi_app(app, environ, buffered=True)
    return int(status.split()[0]), json.loads(b"".join(app_iter))


def _app_warmed_up(settings, headers: dict, path: str, content_type: str, head: bytes):
    """The app on `settings`, after one upload like the measured one (first-use imports and caches)."""
    from api.app import create_app

    app = create_app(settings)
    _post(app, path, content_type, CountingBody(2 * LIMIT, head), headers)
    return app, headers, path, content_type, head


def _post_over_the_limit(state):
    app, headers, path, content_type, head = state
    body = CountingBody(10 * LIMIT, head)
    status, payload = _post(app, path, content_type, body, headers)
    return status, payload, body.served


@pytest.fixture(scope="module")
def limits(platform):
    return dataclasses.replace(platform.settings, max_upload_bytes=LIMIT, max_lines=10**9), platform.auth()


@pytest.fixture(scope="module")
def limited(platform, limits):
    settings, headers = limits
    return platform.app(max_upload_bytes=settings.max_upload_bytes, max_lines=settings.max_lines), headers


UPLOADS = [
    ("/v1/jobs?model=" + MODEL, "application/x-ndjson"),
    ("/v1/jobs", f"multipart/form-data; boundary={BOUNDARY}"),
    ("/v1/files", f"multipart/form-data; boundary={BOUNDARY}"),
]


@pytest.mark.parametrize("path, content_type", UPLOADS)
def test_bytes_over_the_limit_are_cut_off_while_streaming(limits, path, content_type):
    settings, headers = limits
    head = _multipart_head(path.split("?")[0]) if content_type.startswith("multipart") else b""
    prepare = (settings, headers, path, content_type, head)
    (status, payload, served), _, peak = traced_in_child(_app_warmed_up, _post_over_the_limit, *prepare)
    assert status == 413, payload
    assert payload["error"]["code"] == "payload_too_large"
    assert LIMIT < served <= LIMIT + len(head) + SLACK, served
    assert peak < LIMIT, f"peak Python memory {peak} bytes: the upload was buffered"


@pytest.mark.parametrize("path, content_type", UPLOADS)
def test_a_declared_length_over_the_limit_is_refused_before_reading(limited, path, content_type):
    app, headers = limited
    body = CountingBody(10 * LIMIT)
    status, payload = _post(app, path, content_type, body, headers, content_length=10 * LIMIT)
    assert status == 413, payload
    assert body.served == 0


@pytest.mark.parametrize("path, content_type", UPLOADS)
def test_lines_over_the_limit_are_cut_off_while_streaming(platform, path, content_type):
    max_lines = 2000
    app = platform.app(max_upload_bytes=100 * LIMIT, max_lines=max_lines)
    head = _multipart_head(path.split("?")[0]) if content_type.startswith("multipart") else b""
    at_limit = len(head) + max_lines * (len(LINE) + 1)
    body = CountingBody(50 * at_limit, head)
    status, payload = _post(app, path, content_type, body, platform.auth())
    assert status == 413, payload
    assert f"{max_lines} lines" in payload["error"]["message"]
    assert at_limit < body.served <= at_limit + SLACK, body.served


def test_the_server_keeps_serving_after_a_cut_off(limited):
    app, headers = limited
    status, _ = _post(app, "/v1/jobs?model=" + MODEL, "application/x-ndjson", CountingBody(3 * LIMIT), headers)
    assert status == 413
    status, payload = _post(app, "/v1/jobs?model=" + MODEL, "application/x-ndjson", CountingBody(10_000), headers)
    assert status == 201, payload
    assert payload["request_counts"]["total"] > 0
