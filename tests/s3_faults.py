"""A fault-injecting HTTP proxy in front of moto's S3 server, for the S3 fault tests.

Clients (s3fs in the test process and in worker processes) talk to the proxy as their endpoint; the proxy
forwards each request to moto, unless a fault is set: a share of requests answered 503 SlowDown or 500
InternalError (`fail_rate`), a share held past the client's read timeout and then dropped (`timeout_rate`),
every answer delayed (`delay_s`), UploadPart requests cut off mid-body (`drop_upload_parts`: the connection
closes after part of the body was read), or the endpoint gone (`go_down`: nothing listens on the port, a
connection is refused) until `come_back`.
"""

from __future__ import annotations

import contextlib
import http.client
import random
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "expect"}
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
INTERNAL = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error.</Message></Error>"
)


class FaultyS3Proxy:
    def __init__(self, upstream_port: int, port: int = 0, seed: int = 43):
        self.upstream_port = upstream_port
        self.fail_rate = 0.0
        self.timeout_rate = 0.0
        self.hold_s = 4.0  # how long a "timed out" request is held before its connection is dropped
        self.delay_s = 0.0
        self.drop_upload_parts = False
        self.counts: Counter[str] = Counter()  # forwarded, failed_5xx, timed_out, dropped, refused (not seen)
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._connections: set[socket.socket] = set()  # open client connections (kept alive between requests)
        self.down = False
        self.port = port
        self.come_back()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def clear(self) -> None:
        self.fail_rate = self.timeout_rate = self.delay_s = 0.0
        self.drop_upload_parts = False

    def go_down(self) -> None:
        """The endpoint is gone: the port is closed (connections are refused) and open connections are cut."""
        self.down = True
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def come_back(self) -> None:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self.down = False
        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        threading.Thread(target=server.serve_forever, name="s3-fault-proxy", daemon=True).start()

    def close(self) -> None:
        self.go_down()

    def _draw(self) -> str | None:
        with self._lock:
            roll = self._random.random()
        if roll < self.fail_rate:
            return "fail"
        if roll < self.fail_rate + self.timeout_rate:
            return "timeout"
        return None

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1


class _Handler(BaseHTTPRequestHandler):
    owner: FaultyS3Proxy
    protocol_version = "HTTP/1.1"

    def log_message(self, *_args) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner._connections.add(self.connection)

    def finish(self) -> None:
        with self.owner._lock:
            self.owner._connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        proxy = self.owner
        if proxy.down:  # a request on a connection opened before the endpoint went away
            self._drop()
            return
        is_part = "partNumber=" in self.path and "uploadId=" in self.path and self.command == "PUT"
        if is_part and proxy.drop_upload_parts:  # the connection drops mid-upload: half the body read
            self.rfile.read(max(int(self.headers.get("Content-Length") or 0) // 2, 1))
            proxy.count("dropped")
            self._drop()
            return
        body = self._body()
        fault = proxy._draw()
        if proxy.delay_s:
            time.sleep(proxy.delay_s)
        if fault == "timeout":
            proxy.count("timed_out")
            time.sleep(proxy.hold_s)
            self._drop()
            return
        if fault == "fail":
            proxy.count("failed_5xx")
            slow = proxy._random.random() < 0.5
            self._answer(
                503 if slow else 500,
                SLOW_DOWN if slow else INTERNAL,
                {"Content-Type": "application/xml"},
                head=self.command == "HEAD",  # a HEAD answer has no body: bytes left over would corrupt the next one
            )
            return
        proxy.count("forwarded")
        upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            kept = {k: v for k, v in response.getheaders() if k.lower() not in HOP_HEADERS | {"content-length"}}
            self._answer(
                response.status, data, kept, head=self.command == "HEAD", length=response.getheader("Content-Length")
            )
        finally:
            upstream.close()

    def _answer(self, status: int, data: bytes, headers: dict, head: bool = False, length=None) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(length if head and length is not None else len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def _drop(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
