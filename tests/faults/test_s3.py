"""S3 faults through a fault-injecting proxy in front of moto's server (tests/s3_faults.py): 5xx answers,
timeouts, slow responses, a connection dropped mid multipart upload, the endpoint gone for a while. The storage
layer classifies each; a worker on S3 completes a 2,000-line job whole, each line exactly once, with a tenth of
the calls failing; and a job whose storage is unreachable mid-job (PAGEDBATCH_TEST_S3_OUTAGE_S seconds, 20 by
default; the issue's 2 minutes with 120) completes once it returns. Readiness and metrics show the condition.

botocore retries here too (FSSPEC_S3), s3fs up to 5 times; the faults that pass them reach our layer, and each
attempt they retried is counted (store.filestore.storage_retries) and, sustained, makes /readyz say degraded."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import urllib.request
from collections import Counter

import pytest

from store.filestore import storage_health, storage_retries
from store.filestore.storage import atomic_write, get_storage, url_to_fs
from store.filestore.storage_faults import TRANSIENT, classify, health, retrying
from store.filestore.storage_health import StorageCollector, _probes, check_storage
from store.settings import Settings
from tests.fault_fixtures import RECOVERY_ENV
from tests.helpers import MODEL, REPO, chat_line, free_port, jsonl, spawn
from tests.s3_faults import FaultyS3Proxy
from tests.store.test_s3_storage import BUCKET, s3, s3_deployment  # noqa: F401 - the fixtures

S3_CONF = {"config_kwargs": {"read_timeout": 2, "connect_timeout": 2, "retries": {"max_attempts": 2}}}
OUTAGE_S = float(os.environ.get("PAGEDBATCH_TEST_S3_OUTAGE_S") or 20)
LINES = int(os.environ.get("PAGEDBATCH_TEST_S3_LINES") or 2000)


@pytest.fixture(scope="module")
def proxy(s3):  # noqa: F811
    """The proxy in front of moto, as the endpoint of this process's s3fs (and the workers')."""
    import fsspec.config
    import s3fs

    import store.filestore.storage

    moto_port = int(s3.env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    faulty = FaultyS3Proxy(moto_port)
    saved_endpoint, saved_conf = os.environ["AWS_ENDPOINT_URL"], fsspec.config.conf.get("s3")
    os.environ["AWS_ENDPOINT_URL"] = faulty.url
    fsspec.config.conf["s3"] = S3_CONF
    s3fs.S3FileSystem.clear_instance_cache()
    store.filestore.storage._cache.clear()
    yield faulty
    faulty.close()
    os.environ["AWS_ENDPOINT_URL"] = saved_endpoint
    if saved_conf is None:
        fsspec.config.conf.pop("s3", None)
    else:
        fsspec.config.conf["s3"] = saved_conf
    s3fs.S3FileSystem.clear_instance_cache()
    store.filestore.storage._cache.clear()


@pytest.fixture(autouse=True)
def own_retry_window(monkeypatch):
    """Each test counts the S3 client's retries in a window of its own (later tests' readiness stays ok)."""
    monkeypatch.setattr(storage_retries, "recent", storage_retries._Recent())


def _uploads(s3) -> list[str]:  # noqa: F811
    return [u["Key"] for u in s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]


@pytest.mark.slow
def test_the_storage_layer_classifies_each_s3_fault(s3, proxy):  # noqa: F811
    proxy.clear()
    fs, root = url_to_fs(f"s3://{BUCKET}/layer", {"default_block_size": 5 * 1024 * 1024, "skip_instance_cache": True})
    path = f"{root}/a.bin"
    fs.retries = 2  # s3fs's own retries (5 by default), fewer to keep the test short

    def write(data: bytes) -> None:
        with atomic_write(fs, path) as f:
            f.write(data)

    proxy.fail_rate = 1.0  # every call 503 SlowDown or 500 InternalError
    with pytest.raises(Exception) as failed:
        write(b"x" * 100)
    assert classify(failed.value) == TRANSIENT
    proxy.clear()
    assert not fs.exists(path)

    proxy.timeout_rate, proxy.hold_s = 1.0, 2.5  # held past the 2 s read timeout, then dropped
    with pytest.raises(Exception) as timed_out:
        write(b"x" * 100)
    assert classify(timed_out.value) == TRANSIENT
    proxy.clear()

    proxy.go_down()  # nothing listens: connections refused
    try:
        with pytest.raises(Exception) as gone:
            fs.cat(path)
        assert classify(gone.value) == TRANSIENT
    finally:
        proxy.come_back()

    big = os.urandom(6 * 1024 * 1024)  # over one block: a multipart upload
    proxy.drop_upload_parts = True  # each part's connection drops mid-body
    with pytest.raises(Exception) as dropped:
        write(big)
    assert classify(dropped.value) == TRANSIENT and proxy.counts["dropped"] >= 1
    proxy.clear()
    assert not fs.exists(path) and _uploads(s3) == []  # nothing visible, the multipart upload aborted
    write(big)
    fs.invalidate_cache()
    assert fs.cat(path) == big  # once the storage is back, whole

    proxy.delay_s = 0.5  # slow answers are only slow
    t0 = time.monotonic()
    assert fs.cat(path)[:10] == big[:10] and time.monotonic() - t0 >= 0.5
    proxy.clear()
    proxy.fail_rate = 0.6  # transient failures of an idempotent read are retried with backoff
    assert retrying(lambda: fs.cat(path), "reading", attempts=12, base_s=0.05) == big
    proxy.clear()


def _client_retries() -> int:
    """Failed S3 attempts counted so far in this process (the S3 client's own retries, op "S3 <Operation>")."""
    counts, _failing = health.snapshot()
    return sum(n for (kind, op), n in counts.items() if kind == TRANSIENT and op.startswith("S3 "))


def test_the_s3_clients_own_retries_are_counted_and_readiness_says_so(s3, proxy, monkeypatch, caplog):  # noqa: F811
    import fsspec.config

    retries = {"retries": {"max_attempts": 10}}  # enough that every call passes in the end
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {**S3_CONF["config_kwargs"], **retries}})
    settings = Settings(storage_url=f"s3://{BUCKET}/client-retries")
    storage = get_storage(settings.storage_url)

    def ready() -> dict:
        _probes.clear()
        return check_storage(settings)

    def retrying_gauge() -> float:
        families = {f.name: f for f in StorageCollector(settings).collect()}
        return families["pagedbatch_storage_retrying"].samples[0].value

    proxy.clear()
    before = _client_retries()
    proxy.counts.clear()
    for i in range(5):
        with storage.open_write(f"ok/{i}") as f:
            f.write(b"x")
    assert _client_retries() == before and ready()["status"] == "ok" and retrying_gauge() == 0.0

    proxy.fail_rate = 0.3  # a share of the calls answered 503 SlowDown or 500 InternalError
    with caplog.at_level(logging.WARNING, logger=storage_retries.__name__):
        for i in range(8):
            with storage.open_write(f"flaky/{i}") as f:
                f.write(b"line %d\n" % i)
            with storage.open_read(f"flaky/{i}") as f:
                assert f.read() == b"line %d\n" % i  # every call passed: the client retried the failed ones
    proxy.clear()
    failed = proxy.counts["failed_5xx"]
    assert failed >= storage_retries.MIN_FAILED
    assert _client_retries() - before == failed  # each 5xx answer counted once, as a transient storage error
    verdict = ready()
    assert verdict["status"] == "degraded" and verdict["writable"] is True, verdict
    assert verdict["reasons"][0].startswith(f"storage_retrying: {failed} of "), verdict
    assert retrying_gauge() == 1.0
    assert sum("storage_retrying" in r.getMessage() for r in caplog.records) == 1  # logged once, not per retry

    monkeypatch.setattr(storage_retries, "WINDOW_S", 1)  # the retries age out of the window
    time.sleep(2.1)
    assert ready()["status"] == "ok" and retrying_gauge() == 0.0


@pytest.fixture
def s3_worker(s3, proxy, s3_deployment, tmp_path):  # noqa: F811
    """A worker on the S3 deployment, talking to S3 through the proxy, with its metrics port."""
    settings, api_key = s3_deployment
    settings = dataclasses.replace(settings, shard_size=200)
    port = free_port()
    # short sweeps; leases long enough for calls that time out and are retried (a 2 s lease would be lost)
    env = {
        **os.environ,
        **settings.to_env(),
        **s3.env,
        **RECOVERY_ENV,
        "PAGEDBATCH_LEASE_S": "20",
        "AWS_ENDPOINT_URL": proxy.url,
        "FSSPEC_S3": json.dumps(S3_CONF),
        "PAGEDBATCH_STORAGE_RETRY_MAX_S": "3",
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": str(tmp_path),
    }
    log = tmp_path / "worker.log"
    proc = spawn(
        [
            sys.executable,
            "-m",
            "pagedbatch",
            "worker",
            "--model",
            f"{MODEL}={_model_path(settings)}",
            "--concurrency=2",
            "--device=cpu",
            f"--metrics-port={port}",
        ],
        log,
        cwd=REPO,
        env=env,
    )
    deadline = time.monotonic() + 120
    while " ready." not in log.read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)
    yield settings, api_key, port, log
    proc.terminate()
    proc.wait(timeout=30)


def _model_path(settings) -> str:
    return settings.models[MODEL]


def _client(settings, api_key):
    from api.app import create_app

    client = create_app(settings).test_client()
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {api_key}"
    return client


def _submit(client, lines) -> str:
    """Create a job; an upload the storage refused for now (503 + Retry-After) is sent again."""
    for _ in range(20):
        created = client.post(f"/v1/jobs?model={MODEL}", data=jsonl(lines), content_type="application/x-ndjson")
        if created.status_code == 201:
            return created.get_json()["id"]
        assert created.status_code == 503 and created.headers["Retry-After"], created.get_json()
        time.sleep(0.5)
    raise AssertionError("the upload never went through")


def _wait(client, job_id, timeout, log=None):
    deadline = time.monotonic() + timeout
    while (job := client.get(f"/v1/jobs/{job_id}").get_json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, (job, log.read_text()[-6000:] if log else "")
        time.sleep(0.3)
    return job


def _metrics(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def _sample(text: str, prefix: str) -> float:
    """The sum of the samples whose line starts with `prefix` in a Prometheus text page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def _exactly_once(client, s3, settings, job_id, ids):  # noqa: F811
    import io

    import pyarrow.parquet as pq

    for _ in range(10):  # reading the results goes through the (still faulty) proxy too
        response = client.get(f"/v1/jobs/{job_id}/results?format=jsonl")
        if response.status_code == 200:
            break
        time.sleep(0.5)
    output = response.get_data(as_text=True).splitlines()
    assert Counter(json.loads(line)["custom_id"] for line in output) == Counter(ids)
    prefix = settings.storage_url.split("/", 3)[3]
    merged = s3.get_object(Bucket=BUCKET, Key=f"{prefix}/results/{job_id}/results.parquet")["Body"].read()
    assert pq.read_table(io.BytesIO(merged)).column("line").to_pylist() == list(range(1, len(ids) + 1))
    assert _uploads(s3) == []


@pytest.mark.slow
def test_a_2000_line_job_completes_whole_with_a_tenth_of_s3_calls_failing(s3, proxy, s3_worker, monkeypatch):  # noqa: F811
    settings, api_key, port, log = s3_worker
    monkeypatch.setattr(storage_health, "PROBE_TTL_S", 0.0)  # each /readyz below probes S3 (through the proxy)
    client = _client(settings, api_key)
    proxy.clear()
    proxy.counts.clear()
    proxy.fail_rate, proxy.timeout_rate = 0.05, 0.05  # a tenth of the calls: 5xx or a timeout
    ids = [f"t{i}" for i in range(LINES)]
    t0, here_before = time.monotonic(), _client_retries()
    job_id = _submit(client, [chat_line(cid, f"q {i}", max_tokens=2) for i, cid in enumerate(ids)])
    retrying, degraded = set(), None  # while it runs: the worker's retrying gauge, the API's readiness
    while (done := client.get(f"/v1/jobs/{job_id}").get_json())["status"] not in ("completed", "failed"):
        assert time.monotonic() - t0 < 300, (done, log.read_text()[-6000:])
        retrying.add(_sample(_metrics(port), "pagedbatch_storage_retrying"))
        ready = client.get("/readyz").get_json()
        if any(r.startswith("storage_retrying: ") for r in ready["storage"]["reasons"]):
            degraded = ready
        time.sleep(0.5)
    took = time.monotonic() - t0
    injected = dict(proxy.counts)
    proxy.clear()
    # the proxy counts a fault as the request arrives; the client counts it when the answer (or its 2 s read
    # timeout) comes back, so attempts still in flight when the job completed are counted a moment later
    injected_failures = injected.get("failed_5xx", 0) + injected.get("timed_out", 0)
    settle = time.monotonic() + 3 * S3_CONF["config_kwargs"]["read_timeout"]
    while True:
        worker_counted = _sample(_metrics(port), 'pagedbatch_storage_errors_total{kind="transient",op="S3 ')
        here_counted = _client_retries() - here_before
        if worker_counted + here_counted >= injected_failures or time.monotonic() > settle:
            break
        time.sleep(0.5)
    print(
        f"\n2,000 lines with 10% of S3 calls failing: {done['status']} in {took:.0f}s; proxy {injected}; "
        f"client retries counted: worker {worker_counted:.0f}, API {here_counted}; readiness {degraded}"
    )
    assert done["status"] == "completed" and done["request_counts"]["completed"] == LINES, done
    assert done["status_detail"] is None
    assert injected["failed_5xx"] > 0 and injected["timed_out"] > 0
    _exactly_once(client, s3, settings, job_id, ids)
    # s3fs and botocore retried these calls themselves, and they were counted as they went: each injected fault
    # once (the margin only for an attempt still past its read timeout when the settling above gave up)
    assert worker_counted > 0 and here_counted > 0, (worker_counted, here_counted)
    assert 0.9 * injected_failures <= worker_counted + here_counted <= injected_failures, (
        worker_counted,
        here_counted,
        injected,
    )
    assert 1.0 in retrying, retrying  # the worker's gauge said so during the fault ...
    assert degraded and degraded["status"] == "degraded", degraded  # ... and so did the API's readiness
    assert 'pagedbatch_storage_failing{kind="transient"} 0.0' in _metrics(port)  # none reached our layer's retries


@pytest.mark.slow
def test_s3_unreachable_mid_job_the_job_waits_says_why_and_completes_after_it_returns(s3, proxy, s3_worker):  # noqa: F811
    settings, api_key, port, log = s3_worker
    client = _client(settings, api_key)
    proxy.clear()
    ids = [f"o{i}" for i in range(300)]
    job_id = _submit(client, [chat_line(cid, f"q {i}", max_tokens=8, ignore_eos=True) for i, cid in enumerate(ids)])
    deadline = time.monotonic() + 120
    while client.get(f"/v1/jobs/{job_id}").get_json()["request_counts"]["completed"] < 20:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    proxy.go_down()
    down_at = time.monotonic()
    try:
        while not (job := client.get(f"/v1/jobs/{job_id}").get_json())["status_detail"]:
            assert job["status"] != "completed" and time.monotonic() - down_at < min(OUTAGE_S, 60), job
            time.sleep(0.3)
        print(f"\nS3 gone: the job says {job['status_detail']!r} after {time.monotonic() - down_at:.1f}s")
        assert job["status_detail"].startswith("storage_unavailable: ") and "will retry" in job["status_detail"]
        ready = client.get("/readyz").get_json()
        assert ready["status"] == "degraded" and ready["storage"]["writable"] is False, ready
        assert ready["storage"]["reasons"][0].startswith("storage_unavailable: ")
        assert 'pagedbatch_storage_failing{kind="transient"} 1.0' in _metrics(port)
        while time.monotonic() - down_at < OUTAGE_S:
            job = client.get(f"/v1/jobs/{job_id}").get_json()
            assert job["status"] in ("in_progress", "finalizing"), job  # never completed short, never failed
            time.sleep(1)
    finally:
        proxy.come_back()
    back = time.monotonic()
    done = _wait(client, job_id, 120)
    print(f"S3 back after {back - down_at:.0f}s: the job {done['status']} {time.monotonic() - back:.1f}s later")
    assert done["status"] == "completed" and done["status_detail"] is None, done
    _exactly_once(client, s3, settings, job_id, ids)
    assert log.read_text().count("storage storage_unavailable") <= 4  # once per condition, not per retry
