"""Local storage filling up under a real worker: the storage directory on a small tmpfs, filled to the last byte
mid-job, then given its space back. The job never completes short, says why while it waits, and completes whole
within 30 s once space returns, with no process restarted; earlier results stay readable; an upload while full
answers 507 and leaves nothing; readiness and metrics show it. Needs `mount` (root); where the test cannot mount,
tests/store/test_storage_faults.py covers the same claimants through a storage wrapper that raises ENOSPC."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from store.db import session_scope
from store.models import File
from tests.helpers import chat_line, jsonl, long_line, validated

pytestmark = pytest.mark.slow


@pytest.fixture
def tmpfs():
    mnt = Path(tempfile.mkdtemp(prefix="pagedbatch-tmpfs-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m,mode=0700", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        mnt.rmdir()
        pytest.skip(
            f"this machine lets no test mount a tmpfs ({mounted.stderr.strip()}); the ENOSPC wrapper "
            "of tests/store/test_storage_faults.py covers the claimants"
        )
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)
    with contextlib.suppress(OSError):
        mnt.rmdir()


def fill(folder: Path) -> None:
    """Write a new ballast file in `folder` until the filesystem has not one byte left. Called again, it takes
    what came back since: a worker write that failed for want of space gives its pages back when it is removed."""
    path = folder / f"ballast-{len(list(folder.glob('ballast-*')))}"
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)
    assert os.statvfs(folder).f_bavail == 0


def empty(folder: Path) -> None:
    for ballast in folder.glob("ballast-*"):
        ballast.unlink()


def _temporary_files(root: Path) -> list[str]:
    return [n for _, _, names in os.walk(root) for n in names if n.endswith(".tmp") and "ballast" not in n]


def test_storage_filling_mid_job_waits_says_why_and_completes_whole_once_space_returns(fresh_workers, tmpfs):
    from api.app import create_app

    h = fresh_workers
    storage = tmpfs / "storage"
    settings = dataclasses.replace(
        h.settings, storage_url=str(storage), shard_size=20, storage_retry_max_s=2, storage_min_free_bytes=256 * 1024
    )
    client = create_app(settings).test_client()
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {h.api_key}"
    worker = h.start_worker(PAGEDBATCH_STORAGE_URL=str(storage), PAGEDBATCH_STORAGE_RETRY_MAX_S="2")

    def job(job_id):
        return client.get(f"/v1/jobs/{job_id}").get_json()

    def submit(lines):
        created = client.post("/v1/jobs?model=tiny", data=jsonl(lines), content_type="application/x-ndjson")
        assert created.status_code == 201, created.get_json()
        return validated(client, created)

    def wait(job_id, timeout):
        deadline = time.monotonic() + timeout
        while (current := job(job_id))["status"] not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() < deadline, current
            time.sleep(0.2)
        return current

    earlier = submit([chat_line(f"e{i}", f"earlier {i}") for i in range(8)])
    assert wait(earlier["id"], 120)["status"] == "completed"
    earlier_output = client.get(f"/v1/jobs/{earlier['id']}/results?format=jsonl").get_data()
    assert len(earlier_output.splitlines()) == 8

    ids = [f"f{i}" for i in range(200)]
    big = submit([long_line(cid, content=f"story {cid}", max_tokens=12) for cid in ids])
    assert big["shards"] == 10
    started = time.monotonic()
    deadline = started + 120
    while job(big["id"])["request_counts"]["completed"] < 40:  # a few shards written, most still to run
        assert time.monotonic() < deadline
        time.sleep(0.1)
    print(f"\n40 of 200 lines in {time.monotonic() - started:.1f}s; filling the storage")
    fill(tmpfs)

    deadline = time.monotonic() + 60
    while not (waiting := job(big["id"]))["status_detail"]:
        assert waiting["status"] != "completed", "completed while the storage was full"
        assert time.monotonic() < deadline, waiting
        time.sleep(0.2)
    assert waiting["status_detail"].startswith("storage_full: ") and "will retry" in waiting["status_detail"]
    batch = client.get(f"/v1/batches/{big['id']}").get_json()
    assert {"code": "storage_full", "message": waiting["status_detail"], "param": None, "line": None} in (
        batch["errors"]["data"]
    )
    deadline = time.monotonic() + 30
    while True:  # the worker's failed writes may give pages back; readiness must see the storage full
        fill(tmpfs)
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.get_json()["status"] == "degraded", ready.get_json()
        verdict = ready.get_json()["storage"]
        assert verdict["free_bytes"] < settings.storage_min_free_bytes, verdict
        if verdict["writable"] is False:
            break
        assert time.monotonic() < deadline, verdict
        time.sleep(0.5)
    assert any(reason.startswith("storage_full: ") for reason in verdict["reasons"])
    files_before, stored_before = _file_rows(settings), sorted(os.listdir(storage / "files"))
    fill(tmpfs)
    upload = client.post(
        "/v1/jobs?model=tiny", data=jsonl([chat_line("late", "hello")] * 50), content_type="application/x-ndjson"
    )
    assert upload.status_code == 507 and upload.get_json()["error"]["code"] == "storage_full", upload.get_json()
    assert "Errno" not in upload.get_json()["error"]["message"]
    assert _file_rows(settings) == files_before  # no file record
    assert sorted(os.listdir(storage / "files")) == stored_before  # no bytes, no temporary file
    metrics = client.get("/metrics").get_data(as_text=True)
    assert 'pagedbatch_storage_errors_total{kind="full",op="storing the uploaded file"}' in metrics
    assert 'pagedbatch_storage_failing{kind="full"} 1.0' in metrics
    free_metric = re.search(r"^pagedbatch_storage_free_bytes (\S+)$", metrics, re.M)
    assert free_metric and float(free_metric[1]) < settings.storage_min_free_bytes, free_metric
    # earlier results stay readable, the API answers, and the job does not end short while it waits
    assert client.get(f"/v1/jobs/{earlier['id']}/results?format=jsonl").get_data() == earlier_output
    time.sleep(5)
    still = job(big["id"])
    assert still["status"] in ("in_progress", "finalizing") and still["status_detail"], still

    before = still["request_counts"]["completed"]
    empty(tmpfs)  # space returns; no process restarts
    back = time.monotonic()
    while job(big["id"])["request_counts"]["completed"] == before:
        assert time.monotonic() - back < 30
        time.sleep(0.1)
    resumed = time.monotonic() - back
    done = wait(big["id"], 60)
    took = time.monotonic() - back
    print(
        f"space returned with {before}/200 lines written: the next shard written after {resumed:.1f}s, "
        f"the job completed after {took:.1f}s"
    )
    assert done["status"] == "completed" and took < 30, (done, took)
    assert done["status_detail"] is None and done["request_counts"]["completed"] == len(ids)
    output = client.get(f"/v1/jobs/{big['id']}/results?format=jsonl").get_data(as_text=True).splitlines()
    assert Counter(json.loads(line)["custom_id"] for line in output) == Counter(ids)  # each line exactly once
    assert _temporary_files(storage) == []
    time.sleep(2.1)  # the readiness probe's verdict is cached for 2 s
    assert client.get("/readyz").get_json()["status"] == "ok"
    logged = worker.text().count("storage storage_full")
    assert 1 <= logged <= 6, worker.text()[-4000:]  # once per condition, not once per retry


def _file_rows(settings) -> int:
    with session_scope(settings.database_url) as s:
        return s.query(File).count()
