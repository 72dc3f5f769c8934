"""A worker's Prometheus endpoint behind a bearer token (PAGEDBATCH_METRICS_TOKEN), the same token the API's
/metrics takes; prometheus_client's own server has no authentication."""

from __future__ import annotations

import hmac
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args):  # scrapes every few seconds: not worth a log line each
        pass


def with_token(app, token: str):
    """`app` for requests carrying `Authorization: Bearer <token>`; a 401 for the others."""
    expected = token.encode()

    def guarded(environ, start_response):
        scheme, _, sent = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode(), expected):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="pagedbatch-metrics"')],
        )
        return [b"metrics need the bearer token (PAGEDBATCH_METRICS_TOKEN)\n"]

    return guarded


def serve_with_token(registry: CollectorRegistry, port: int, token: str, addr: str = "0.0.0.0") -> WSGIServer:
    """Serve `registry` on `port` in a daemon thread, for scrapes that send `token`."""
    server = make_server(addr, port, with_token(make_wsgi_app(registry), token), _Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
