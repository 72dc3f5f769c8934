"""Prometheus metrics: the API's `/metrics` (requests, latency, jobs, queue depth; summed over gunicorn
workers) and a worker's `--metrics-port` (tokens, sequences, KV blocks, prefix cache, steps, shards)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

from pagedbatch.client import Client
from tests.helpers import MODEL, REPO, chat_line, free_port, jsonl, long_line, spawn, validated


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, for every sample of an exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return parse(r.read().decode())


def _post_job(client, lines) -> dict:
    r = client.post(f"/v1/jobs?model={MODEL}", data=jsonl(lines), content_type="application/x-ndjson")
    assert r.status_code in (200, 201), r.get_json()
    return validated(client, r)


def test_api_metrics_count_requests_by_route_template_and_status(platform):
    client = platform.app().test_client()
    before = parse(client.get("/metrics").get_data(as_text=True))
    route = "/v1/jobs/<job_id>"
    assert client.get("/v1/jobs/job_nope").status_code == 404
    assert client.get("/v1/jobs/job_other").status_code == 404
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/no/such/path").status_code == 404
    r = client.get("/metrics")
    assert r.status_code == 200 and r.content_type.startswith("text/plain")
    after = parse(r.get_data(as_text=True))

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    total = "pagedbatch_http_requests_total"
    assert moved(total, method="GET", route=route, status="404") == 2  # the template, not the ids
    assert moved(total, method="GET", route="/v1/jobs", status="401") == 1
    assert moved(total, method="GET", route="unmatched", status="404") == 1
    latency = "pagedbatch_http_request_duration_seconds_count"
    assert moved(latency, method="GET", route=route) == 2
    assert value(after, "pagedbatch_http_request_duration_seconds_sum", method="GET", route=route) > 0


def test_api_metrics_jobs_by_status_and_queue_depth(platform):
    # a queue nobody serves, so the shards stay queued
    client = platform.app(queue_prefix=f"{platform.settings.queue_prefix}-metrics").test_client()
    before = parse(client.get("/metrics").get_data(as_text=True))
    assert value(before, "pagedbatch_queue_depth", model=MODEL) == 0
    job = _post_job(client, [chat_line(f"q-{i}", "hello") for i in range(20)])  # 8 a shard: 3 shards
    assert job["status"] == "in_progress"
    _post_job(client, ["{broken"])  # every line bad: the job fails at once
    after = parse(client.get("/metrics").get_data(as_text=True))
    assert value(after, "pagedbatch_queue_depth", model=MODEL) == 3
    for status in ("in_progress", "failed"):
        assert value(after, "pagedbatch_jobs", status=status) == value(before, "pagedbatch_jobs", status=status) + 1
    assert ("pagedbatch_jobs", frozenset({("status", "expired")})) in after  # every status, zero included
    assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200  # no worker runs it later


def test_worker_metrics_move_as_a_job_runs(live_url, worker, tmp_path):
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
    before = scrape(url)
    assert value(before, "pagedbatch_kv_blocks_used", model=MODEL) == 0
    free = value(before, "pagedbatch_kv_blocks_free", model=MODEL)
    assert free > 0
    seen: list[dict] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.append(scrape(url))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    client = Client(live_url, api_key=worker.api_key)
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([long_line(f"m-{i}", "the same long shared prefix " * 8) for i in range(16)]))
    job = client.wait(client.submit(src, model=MODEL)["id"], timeout=180, poll_s=0.2)
    done.set()
    watcher.join()
    assert job["status"] == "completed", job
    after = scrape(url)

    def moved(name, **labels):
        return value(after, name, model=MODEL, **labels) - value(before, name, model=MODEL, **labels)

    assert moved("pagedbatch_requests_finished_total") >= 16
    assert moved("pagedbatch_generation_tokens_total") >= job["usage"]["completion_tokens"] == 16 * 48
    assert moved("pagedbatch_prompt_tokens_total") >= job["usage"]["prompt_tokens"] > 0
    assert moved("pagedbatch_prefix_cache_queries_total") == moved("pagedbatch_prompt_tokens_total")
    assert moved("pagedbatch_prefix_cache_hits_total") > 0  # 16 prompts sharing a long prefix
    assert moved("pagedbatch_engine_step_seconds_count") >= 48
    # 16 lines, 8 a shard (the sweeper may also hand this worker shards other tests left queued)
    assert moved("pagedbatch_shard_duration_seconds_count", outcome="done") >= 2
    assert moved("pagedbatch_engine_errors_total") == 0
    assert any(value(s, "pagedbatch_sequences_running", model=MODEL) > 0 for s in seen)
    assert any(value(s, "pagedbatch_kv_blocks_used", model=MODEL) > 0 for s in seen)
    assert value(after, "pagedbatch_kv_blocks_used", model=MODEL) == 0  # every block back
    assert value(after, "pagedbatch_kv_blocks_free", model=MODEL) == free
    assert value(after, "pagedbatch_sequences_running", model=MODEL) == 0
    assert ("pagedbatch_preemptions_total", frozenset({("model", MODEL)})) in after


def test_api_metrics_add_up_over_gunicorn_workers(platform, tmp_path):
    port = free_port()
    env = {**os.environ, **platform.settings.to_env(), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    cmd = [sys.executable, "-m", "pagedbatch", "api", "--host=127.0.0.1", f"--port={port}"]
    cmd += ["--workers=3", "--threads=1"]
    server = spawn(cmd, log=tmp_path / "api.log", cwd=REPO, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/healthz", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "api.log").read_text()
                time.sleep(0.3)
        with ThreadPoolExecutor(8) as pool:  # concurrent connections, spread over the one-thread workers
            list(pool.map(lambda _: urllib.request.urlopen(f"{base}/openapi.json", timeout=10).read(), range(40)))
        counting = list((tmp_path / "prom").glob("counter_*.db"))  # one file per process that counted
        assert len(counting) > 1, "every request went to one worker; the sum proves nothing"
        for _ in range(5):  # whichever worker answers, it reports every worker's requests
            samples = scrape(f"{base}/metrics")
            total = value(samples, "pagedbatch_http_requests_total", method="GET", route="/openapi.json", status="200")
            assert total == 40
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
