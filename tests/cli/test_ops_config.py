"""Operations settings: `serve --metrics-port` gives each worker its Prometheus port, and
PAGEDBATCH_METRICS_TOKEN protects the API's /metrics with a bearer token."""

from __future__ import annotations

from flask.testing import FlaskClient

from pagedbatch.cli import build_parser
from pagedbatch.supervisor import worker_command, worker_metrics_ports


def test_serve_gives_each_worker_a_metrics_port():
    args = build_parser().parse_args(["serve", "--model", "a=/m/a", "--model", "b=/m/b", "--metrics-port=9400"])
    ports = worker_metrics_ports(args, 2)
    assert ports == [9400, 9401]
    for (name, path), port in zip([("a", "/m/a"), ("b", "/m/b")], ports):
        worker_args = build_parser().parse_args(worker_command(name, path, args, port)[3:])
        assert worker_args.metrics_port == port and worker_args.model == [f"{name}={path}"]
    plain = build_parser().parse_args(["serve", "--model", "a=/m/a"])
    assert worker_metrics_ports(plain, 1) == [None]
    assert build_parser().parse_args(worker_command("a", "/m/a", plain, None)[3:]).metrics_port is None


def test_metrics_token(platform, monkeypatch):
    client = FlaskClient(platform.app())  # no API key: /metrics is not behind the tenants' keys
    assert client.get("/metrics").status_code == 200
    monkeypatch.setenv("PAGEDBATCH_METRICS_TOKEN", "s3cret-scrape")
    refused = client.get("/metrics")
    assert refused.status_code == 401 and "Bearer" in refused.headers["WWW-Authenticate"]
    assert "pagedbatch_" not in refused.get_data(as_text=True)
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/metrics", headers={"Authorization": f"Bearer {platform.api_key}"}).status_code == 401
    ok = client.get("/metrics", headers={"Authorization": "Bearer s3cret-scrape"})
    assert ok.status_code == 200 and "pagedbatch_http_requests_total" in ok.get_data(as_text=True)


def test_worker_metrics_port_takes_the_token(monkeypatch):
    import urllib.error
    import urllib.request

    from tests.helpers import free_port
    from workers.metrics.series import WorkerMetrics

    monkeypatch.setenv("PAGEDBATCH_METRICS_TOKEN", "scrape-me")
    metrics = WorkerMetrics("tiny-token")
    metrics.engine_errors.inc()
    port = free_port()
    metrics.serve(port, addr="127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "scrape-me"}):
        try:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
            raise AssertionError(f"{headers} was let in")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401 and exc.headers["WWW-Authenticate"].startswith("Bearer")
    ok = urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "Bearer scrape-me"}), timeout=10)
    assert 'pagedbatch_engine_errors_total{model="tiny-token"} 1.0' in ok.read().decode()
