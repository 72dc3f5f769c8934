"""What the HTTP server answers by itself, before Flask sees a request (a malformed request line, a URL
too long, bad headers), as OpenAI's error JSON rather than the server's HTML: a request handler for
Werkzeug's server (`serve`) and a worker class for gunicorn (`pagedbatch api`)."""

from __future__ import annotations

import http
import re

from gunicorn.workers.gthread import ThreadWorker
from werkzeug.serving import WSGIRequestHandler, make_server

from api.objects import Error, ErrorResponse

_STATUS_LINE = re.compile(rb"^HTTP/1\.[01] (\d{3}) ")


def error_json(status: int, message: str) -> bytes:
    """An OpenAI error body for an HTTP-level error; `code` is the status' name (uri_too_long, ...)."""
    kind = "server_error" if status in (500, 502, 503, 504) else "invalid_request_error"  # 505: the client's
    code = http.HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_") if status in _KNOWN else None
    error = Error(message=message[:500], type=kind, param=None, code=code)
    return ErrorResponse(error=error).model_dump_json().encode()


_KNOWN = frozenset(s.value for s in http.HTTPStatus)


def _response(status: int, reason: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


class JsonErrorRequestHandler(WSGIRequestHandler):
    """Werkzeug's handler (pass as `make_server(..., request_handler=...)`) answering its own errors
    (400, 414, 431, ...) as JSON."""

    def send_error(self, code, message=None, explain=None):
        short, long = self.responses.get(code, ("Error", ""))
        self.log_error("code %d, message %s", code, message or short)
        body = error_json(code, message or long or short)
        self.close_connection = True
        if getattr(self, "request_version", None) is None:  # the request line itself was unreadable
            self.request_version = "HTTP/1.1"
        self.wfile.write(_response(code, short, body if self.command != "HEAD" else b""))


class _JsonErrorSocket:
    """The client socket as gunicorn's error writer sees it: its one HTML error response (status line,
    headers, page) is sent as JSON instead. Everything else goes to the real socket."""

    def __init__(self, sock, message: str):
        self._sock, self._message = sock, message

    def sendall(self, data: bytes) -> None:
        match = _STATUS_LINE.match(data)
        if match is None:
            self._sock.sendall(data)
            return
        status = int(match.group(1))
        reason = data.split(b"\r\n", 1)[0].split(b" ", 2)[-1].decode("latin-1")
        message = self._message if status != 500 else "The server had an error while processing your request."
        self._sock.sendall(_response(status, reason, error_json(status, f"{reason}: {message}")))

    def __getattr__(self, name):
        return getattr(self._sock, name)


class JsonErrorWorker(ThreadWorker):
    """gunicorn's gthread worker, answering the errors gunicorn raises itself as JSON."""

    def handle_error(self, req, client, addr, exc):
        super().handle_error(req, _JsonErrorSocket(client, str(exc)[:300]), addr, exc)


def make_json_error_server(host: str, port: int, app):
    """Werkzeug's threaded server (as `serve` runs the API) answering its own errors as JSON."""
    return make_server(host, port, app, threaded=True, request_handler=JsonErrorRequestHandler)
