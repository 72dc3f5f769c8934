"""Results and files on S3 (`PAGEDBATCH_STORAGE_URL=s3://bucket/prefix`, s3fs), against moto's S3 server on
127.0.0.1: multipart uploads of large parts, a part never visible half-written, and a worker in a second
process (its own temp dir, as on another host) writing parts that the API merges."""

from __future__ import annotations

import dataclasses
import io
import os
import secrets
import sys
import threading
import time

import boto3
import pyarrow.parquet as pq
import pytest

from store.filestore.storage import Storage, url_to_fs
from store.results.parts import ResultsStore
from tests.helpers import MODEL, REPO, chat_line, free_port, jsonl, spawn, wait_for, wait_for_log

BUCKET = "pagedbatch-results"
BLOCK = 5 * 1024 * 1024  # S3's smallest multipart part: parts over it go up in several pieces
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server in a thread; the AWS_* settings s3fs (and a worker process) read point at it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {**AWS_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    client.env = env
    yield client
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()


def _uploads(s3) -> list[str]:
    """Keys of multipart uploads started and neither completed nor aborted."""
    return [u["Key"] for u in s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]


def _row(line: int, text: str) -> dict:
    return {
        "custom_id": f"c-{line}",
        "line": line,
        "status": "completed",
        "output_text": text,
        "prompt_tokens": 1,
        "completion_tokens": 1,
    }


def test_storage_files_round_trip_and_a_failed_write_leaves_nothing(s3):
    storage = Storage(f"s3://{BUCKET}/files-test")
    with storage.open_write("files/a.jsonl") as f:
        f.write(b'{"x": 1}\n')
    assert storage.open_read("files/a.jsonl").read() == b'{"x": 1}\n' and storage.size("files/a.jsonl") == 9
    with storage.open_read("files/a.jsonl") as f:  # line reading takes a size limit (batchfile.lines)
        assert f.readline(4) == b'{"x"' and f.readline(100) == b": 1}\n" and f.readline(100) == b""
    with pytest.raises(RuntimeError), storage.open_write("files/b.jsonl") as f:
        f.write(os.urandom(BLOCK + 1024))  # big enough to start a multipart upload
        f.flush()
        raise RuntimeError("the upload's source broke")
    assert not storage.fs.exists(storage.path("files/b.jsonl"))
    assert _uploads(s3) == []  # aborted, not left behind
    storage.delete("files/a.jsonl")
    assert not storage.fs.exists(storage.path("files/a.jsonl"))


def test_a_large_part_goes_up_in_pieces_and_is_never_seen_half_written(s3):
    store = ResultsStore(f"s3://{BUCKET}/results", storage_options={"default_block_size": BLOCK})
    job, shard = f"job_{secrets.token_hex(4)}", "shard-00000"
    texts = {line: os.urandom(48 * 1024).hex() for line in range(1, 201)}  # ~19 MB of text that barely compresses
    seen: list[int] = []
    stop = threading.Event()

    def reader():  # another host polling the parts: it sees no part, or the whole part
        while not stop.is_set():
            for path in store.list_parts(job):
                seen.append(store.read_part(path).num_rows)
            time.sleep(0.01)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        writer = store.open_part(job, shard, row_group_rows=20)
        for line in sorted(texts, reverse=True):  # rows arrive out of order, as requests finish
            writer.add(_row(line, texts[line]))
            if line == 50:  # most rows written: pieces are uploaded, the part is still invisible
                assert _uploads(s3) == [f"results/{job}/parts/{shard}.parquet"]
                assert store.list_parts(job) == [] and not store.fs.exists(store.part_path(job, shard))
        path = writer.commit()
        time.sleep(0.2)
    finally:
        stop.set()
        thread.join()
    assert set(seen) <= {200} and seen, f"a reader saw {sorted(set(seen))} rows"
    head = s3.head_object(Bucket=BUCKET, Key=path.split("/", 1)[1])
    pieces = int(head["ETag"].strip('"').rsplit("-", 1)[1])  # a multipart object's ETag ends in -<parts>
    assert pieces >= 3 and head["ContentLength"] > 3 * BLOCK
    table = store.read_part(path)
    assert table.column("line").to_pylist() == list(range(1, 201))
    assert table.column("output_text").to_pylist() == [texts[i] for i in range(1, 201)]
    assert _uploads(s3) == []

    discarded = store.open_part(job, "shard-00001", row_group_rows=20)  # an attempt that lost its shard
    for line in range(201, 301):
        discarded.add(_row(line, texts[line - 200]))
    assert _uploads(s3)  # pieces already went up
    discarded.discard()
    assert _uploads(s3) == [] and store.list_parts(job) == [path]


@pytest.fixture
def s3_deployment(s3, platform):
    """Settings of a second deployment on S3 with its own database and queues: workers of the session's
    (local-disk) deployment must neither take its messages nor sweep its shards."""
    from migrations import upgrade
    from pagedbatch.embedded import create_database, drop_database
    from store.db import get_engine
    from store.keys import create_key

    token = secrets.token_hex(4)
    name = f"pagedbatch_s3_{token}"
    create_database(platform.admin_url, name)
    base, _, query = platform.admin_url.partition("?")
    settings = dataclasses.replace(
        platform.settings,
        database_url=base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else ""),
        storage_url=f"s3://{BUCKET}/deploy-{token}",
        queue_prefix=f"pbs3-{token}",
        broker_prefix=f"pbs3-{token}:",
    )
    upgrade(settings.database_url)
    api_key, _ = create_key(settings, settings.default_tenant, name="s3")
    yield settings, api_key
    get_engine(settings.database_url).dispose()
    drop_database(platform.admin_url, name)


@pytest.mark.slow
def test_a_worker_on_another_host_writes_parts_the_api_merges(s3, s3_deployment, platform, tmp_path):
    from flask.testing import FlaskClient

    from api.app import create_app

    settings, api_key = s3_deployment
    host_b = tmp_path / "host-b"  # the worker's own temp dir and home: nothing shared with the API but S3
    host_b.mkdir()
    env = {
        **os.environ,
        **settings.to_env(),
        **s3.env,
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": str(host_b),
        "PAGEDBATCH_HOME": str(host_b / "home"),
    }
    log = tmp_path / "worker-b.log"
    proc = spawn(
        [
            sys.executable,
            "-m",
            "pagedbatch",
            "worker",
            "--model",
            f"{MODEL}={platform.model_path}",
            "--concurrency=2",
            "--device=cpu",
        ],
        log,
        cwd=REPO,
        env=env,
    )
    try:
        wait_for_log(proc, log, " ready.")
        client = FlaskClient(create_app(settings))
        client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {api_key}"
        lines = [chat_line(f"s3-{i}", f"question {i}", max_tokens=3) for i in range(20)] + ["{broken"]
        job = client.post(f"/v1/jobs?model={MODEL}", data=jsonl(lines), content_type="application/x-ndjson")
        assert job.status_code == 201, job.get_json()
        job_id = job.get_json()["id"]
        done = wait_for(lambda: client.get(f"/v1/jobs/{job_id}").get_json(), timeout=120)
        assert done["status"] == "completed", done
        counts = done["request_counts"]
        assert (counts["completed"], counts["invalid"], counts["failed"]) == (20, 1, 0), counts
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    prefix = settings.storage_url.split("/", 3)[3] + "/"  # "deploy-<token>/"
    keys = {o["Key"][len(prefix) :] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]}
    parts = sorted(k for k in keys if k.startswith(f"results/{job_id}/parts/"))
    assert len(parts) == 4  # three shards from the worker, one of the invalid line from the API
    assert f"results/{job_id}/results.parquet" in keys and f"jobs/{job_id}/output.jsonl" in keys
    assert not any(name.startswith(".") for key in keys for name in key.split("/"))  # no temporary objects
    results = client.get(f"/v1/jobs/{job_id}/results")
    table = pq.read_table(io.BytesIO(results.data))
    assert table.column("line").to_pylist() == list(range(1, 22))
    assert table.column("status").to_pylist() == ["completed"] * 20 + ["failed"]
    output = client.get(f"/v1/jobs/{job_id}/results?format=jsonl").get_data(as_text=True).splitlines()
    assert len(output) == 20 and '"custom_id": "s3-0"' in output[0].replace('":"', '": "')
    fs, root = url_to_fs(settings.storage_url)
    assert fs.exists(f"{root}/files/{done['input_file_id']}.jsonl")
    assert not (platform.tmp / "storage" / "results" / job_id).exists()  # nothing landed on the API's disk
