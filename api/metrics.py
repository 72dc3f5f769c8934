"""Prometheus metrics of the API at `/metrics`: requests by route template and status, their latency,
jobs by status and queue depth per model.

The request metrics are counted in each process. Under gunicorn with several workers,
PROMETHEUS_MULTIPROC_DIR (set by `pagedbatch api`) makes prometheus_client keep them in files that
every worker reads back at scrape time, so any worker answers with the sum. Jobs and queue depth are
read from PostgreSQL and Redis when scraped, so they are the same whichever worker answers.
"""

from __future__ import annotations

import hmac
import time

from flask import Blueprint, Flask, Response, g, request
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from api.platform import settings
from broker.queue import queue_size
from settings import ApiSettings, PlatformSettings, current
from store import models_registry
from store.filestore.storage_health import StorageCollector
from store.settings import Settings
from store.stats import jobs_by_status

UNMATCHED = "unmatched"  # requests that matched no route share one label value, whatever their path

REQUESTS = Counter(
    "pagedbatch_http_requests", "HTTP requests answered, by route template and status", ["method", "route", "status"]
)
LATENCY = Histogram(
    "pagedbatch_http_request_duration_seconds",
    "Time to answer an HTTP request (until the response starts; streamed bodies excluded)",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)

bp = Blueprint("metrics", __name__)


class PlatformCollector:
    """Jobs by status and queue depth per model (running or configured), read when scraped."""

    def __init__(self, platform_settings: Settings):
        self.settings = platform_settings

    def collect(self):
        jobs = GaugeMetricFamily("pagedbatch_jobs", "Jobs by status, all tenants", labels=["status"])
        for status, count in jobs_by_status(self.settings).items():
            jobs.add_metric([status], count)
        yield jobs
        depth = GaugeMetricFamily("pagedbatch_queue_depth", "Shard messages waiting per model queue", labels=["model"])
        for model in models_registry.model_paths(self.settings):  # running models and PAGEDBATCH_MODELS
            depth.add_metric([model], queue_size(self.settings, model))
        yield depth


def _start_timer() -> None:
    g.metrics_started = time.perf_counter()


def _count(response: Response) -> Response:
    started = g.pop("metrics_started", None)
    if started is not None:
        rule = request.url_rule
        route = rule.rule if rule is not None else UNMATCHED
        REQUESTS.labels(request.method, route, str(response.status_code)).inc()
        LATENCY.labels(request.method, route).observe(time.perf_counter() - started)
    return response


def process_registry():
    """This process's request metrics, or every gunicorn worker's in multiprocess mode."""
    if not current(ApiSettings).prometheus_multiproc_dir:
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return registry


def _check_token() -> Response | None:
    """With PAGEDBATCH_METRICS_TOKEN set, a scrape must send it as `Authorization: Bearer <token>`."""
    token = current(PlatformSettings).metrics_token
    if not token:
        return None
    scheme, _, sent = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode(), token.encode()):
        return None
    return Response(
        "metrics need the bearer token (PAGEDBATCH_METRICS_TOKEN)\n",
        401,
        {"WWW-Authenticate": 'Bearer realm="pagedbatch-metrics"'},
        content_type="text/plain",
    )


@bp.get("/metrics")
def metrics():
    refused = _check_token()
    if refused is not None:
        return refused
    platform_registry = CollectorRegistry()
    platform_registry.register(PlatformCollector(settings()))
    platform_registry.register(StorageCollector(settings()))
    body = generate_latest(process_registry()) + generate_latest(platform_registry)
    return Response(body, content_type=CONTENT_TYPE_LATEST)


def install(app: Flask) -> None:
    """Time and count every request (the first before_request hook, so refused requests count too)."""
    app.before_request_funcs.setdefault(None, []).insert(0, _start_timer)
    app.after_request(_count)
    app.register_blueprint(bp)
