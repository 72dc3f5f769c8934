"""Storage failures classified once (store.filestore.storage_faults), and what each claimant does with them in-process:
an upload answers 507 and leaves nothing; a finalizer and a validator give their claim back at once, say why
on the job (both API faces) and are finished by the sweeper after a backoff once the storage takes writes;
a permanent failure fails the job with a clear code. The disk fills through a storage wrapper that raises
ENOSPC after N bytes (tests/faults/test_storage.py fills a real tmpfs under worker processes)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import secrets
import time
from datetime import timedelta

import pytest
from openai.types import Batch as OpenAIBatch

import store.filestore.storage
import store.results.parquet
import store.results.part_writer
import store.results.parts
from batchfile.errors import LineError
from store.db import session_scope
from store.filestore.storage_faults import (
    DENIED,
    FULL,
    NOT_FOUND,
    PERMANENT,
    TRANSIENT,
    classify,
    health,
    retrying,
    storage_fault,
)
from store.lifecycle.finalize import maybe_finalize
from store.models import File, Job, Shard, utcnow
from store.results.parts import results_store
from store.results.rows import error_row
from tests.helpers import chat_line, jsonl, validated
from tests.platform.test_ui import _signed_in

REAL_ATOMIC_WRITE = store.filestore.storage.atomic_write


class FillingDisk:
    """Every write through `atomic_write` counts its bytes; once `budget` bytes are written, writes raise
    ENOSPC, as a full disk does. `free()` gives the space back."""

    MODULES = (store.filestore.storage, store.results.parts, store.results.part_writer, store.results.parquet)

    def __init__(self, monkeypatch, budget: int):
        self.left = budget
        for module in self.MODULES:
            monkeypatch.setattr(module, "atomic_write", self._atomic_write)

    def free(self) -> None:
        self.left = 1 << 60

    @contextlib.contextmanager
    def _atomic_write(self, fs, path):
        disk = self
        with REAL_ATOMIC_WRITE(fs, path) as f:

            class Counted:
                def write(self, data) -> int:
                    if len(data) > disk.left:
                        raise OSError(errno.ENOSPC, "No space left on device")
                    disk.left -= len(data)
                    return f.write(data)

                def __getattr__(self, name):
                    return getattr(f, name)

            yield Counted()


def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Put")


def _translated(code: str, status: int) -> OSError:
    """What s3fs raises for a botocore ClientError it has no mapping for (or one it maps to an errno)."""
    from s3fs.errors import translate_boto_error

    return translate_boto_error(_client_error(code, status))


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), FULL),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), FULL),
        (PermissionError(errno.EACCES, "Permission denied"), DENIED),
        (OSError(errno.EROFS, "Read-only file system"), DENIED),
        (FileNotFoundError(errno.ENOENT, "No such file"), NOT_FOUND),
        (OSError(errno.EIO, "Input/output error"), TRANSIENT),
        (TimeoutError("timed out"), TRANSIENT),
        (ConnectionResetError(errno.ECONNRESET, "reset"), TRANSIENT),
        (OSError(errno.EINVAL, "bad"), PERMANENT),
    ],
)
def test_local_errors_are_classified_by_errno(exc, kind):
    assert classify(exc) == kind


def test_s3_errors_are_classified_by_code_status_and_connection_error():
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    assert classify(_translated("SlowDown", 503)) == TRANSIENT
    assert classify(_translated("InternalError", 500)) == TRANSIENT
    assert classify(_translated("WeirdNew5xx", 502)) == TRANSIENT  # unknown code, 5xx status
    assert classify(_translated("AccessDenied", 403)) == DENIED
    assert classify(_translated("NoSuchBucket", 404)) == NOT_FOUND
    assert classify(_translated("InvalidArgument", 400)) == PERMANENT
    assert classify(EndpointConnectionError(endpoint_url="http://x")) == TRANSIENT
    assert classify(ReadTimeoutError(endpoint_url="http://x")) == TRANSIENT
    assert classify(ConnectTimeoutError(endpoint_url="http://x")) == TRANSIENT


def test_database_and_program_errors_are_not_storage_errors():
    from sqlalchemy.exc import OperationalError

    db = OperationalError("select 1", {}, ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert classify(db) is None  # the database's outage is not the storage's
    assert classify(ValueError("bug")) is None and classify(KeyError("x")) is None


def test_a_fault_has_a_code_and_a_sentence_never_the_raw_error():
    fault = storage_fault(OSError(errno.ENOSPC, "No space left on device"), "storing the uploaded file")
    assert (fault.code, fault.status, fault.headers["Retry-After"]) == ("storage_full", 507, "30")
    assert "Errno" not in fault.message and "OSError" not in fault.message and fault.message.endswith(".")
    assert fault.detail("finalizing will retry") == "storage_full: finalizing will retry"
    denied = storage_fault(PermissionError(errno.EACCES, "Permission denied: '/x'"), "writing")
    assert (denied.code, denied.status, denied.retryable, denied.headers) == ("storage_denied", 500, False, {})
    assert storage_fault(ValueError("bug"), "writing") is None


def test_transient_failures_are_retried_with_backoff_others_raise_at_once():
    calls = []

    def flaky():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise _translated("SlowDown", 503)
        return "ok"

    before = health.snapshot()[0].get((TRANSIENT, "reading"), 0)
    assert retrying(flaky, "reading", base_s=0.05) == "ok" and len(calls) == 3
    assert health.snapshot()[0][(TRANSIENT, "reading")] == before + 2  # the metrics count retried failures
    assert calls[1] - calls[0] >= 0.025 and calls[2] - calls[1] >= 0.05  # backoff: half to all of 0.05, 0.1
    denied = []

    def refused():
        denied.append(1)
        raise PermissionError(errno.EACCES, "denied")

    with pytest.raises(PermissionError):
        retrying(refused, "reading", base_s=0.05)
    assert denied == [1]


def test_a_condition_is_logged_once_not_per_retry_and_again_once_it_recovers(caplog):
    health.worked()  # nothing failing before
    caplog.set_level(logging.WARNING, logger="store.filestore.storage_faults")
    caplog.clear()
    for _ in range(5):
        storage_fault(OSError(errno.ENOSPC, "No space left on device"), "writing a shard's results")
    health.worked()
    storage_fault(OSError(errno.ENOSPC, "No space left on device"), "writing a shard's results")
    health.worked()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("storage storage_full" in m for m in messages) == 2, messages
    assert sum("recovered from storage_full" in m for m in messages) == 2, messages
    counts, failing = health.snapshot()
    assert counts[(FULL, "writing a shard's results")] >= 6 and failing == []


# ---- claimants against a private deployment (its own database: no worker's sweeper interferes) ----------


@pytest.fixture
def deployment(platform, tmp_path):
    from migrations import upgrade
    from pagedbatch.embedded import create_database, drop_database
    from store.db import get_engine

    token = secrets.token_hex(4)
    name = f"pagedbatch_i43_{token}"
    create_database(platform.admin_url, name)
    base, _, query = platform.admin_url.partition("?")
    settings = dataclasses.replace(
        platform.settings,
        database_url=base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else ""),
        storage_url=str(tmp_path / "storage"),
        queue_prefix=f"pbi43-{token}",
        broker_prefix=f"pbi43-{token}:",
        storage_retry_max_s=0.3,
    )
    upgrade(settings.database_url)
    yield settings
    get_engine(settings.database_url).dispose()
    drop_database(platform.admin_url, name)


def _finished_job(settings, rows: int = 3) -> str:
    """A job whose one shard is done (its part written): only the finalize is left."""
    job_id, now = f"batch_{secrets.token_hex(6)}", utcnow()
    with session_scope(settings.database_url) as s:
        s.add(
            File(
                id=f"file-{job_id}",
                tenant="default",
                purpose="batch",
                filename="in.jsonl",
                bytes=1,
                storage_key="files/none.jsonl",
            )
        )
        s.flush()
        s.add(
            Job(
                id=job_id,
                tenant="default",
                status="in_progress",
                input_file_id=f"file-{job_id}",
                request_total=rows,
                invalid_lines=0,
                shard_count=1,
                validated_at=now,
                in_progress_at=now,
                expires_at=now + timedelta(hours=24),
                on_invalid_lines="skip",
            )
        )
        s.flush()
        part = results_store(settings).write_part(
            job_id,
            f"{job_id}.00000",
            [
                error_row(LineError(line, f"c{line}", "invalid_request", "bad"), created_at=now)
                for line in range(1, rows + 1)
            ],
        )
        s.add(
            Shard(
                id=f"{job_id}.00000",
                job_id=job_id,
                index=0,
                model="tiny",
                status="done",
                request_count=rows,
                input_key="x",
                part_key=part,
                finished_at=now,
            )
        )
    return job_id


def _job(settings, job_id) -> Job:
    with session_scope(settings.database_url) as s:
        return s.get(Job, job_id)


def _cli_status(monkeypatch, job: dict, capsys) -> str:
    """What `pagedbatch status JOB` prints to stderr for this job object."""
    from types import SimpleNamespace

    from pagedbatch.commands import client_commands

    monkeypatch.setattr(client_commands, "_Api", lambda _args: SimpleNamespace(job=lambda _id: job))
    capsys.readouterr()
    assert client_commands._status(SimpleNamespace(job_id=job["id"], json=True)) == 0
    return capsys.readouterr().err


def test_a_finalizer_that_hits_a_full_disk_gives_its_claim_back_and_the_sweeper_finishes_it(
    deployment, monkeypatch, capsys
):
    from api.app import create_app
    from workers.sweeper import _finalize_finished_jobs

    settings = deployment
    job_id = _finished_job(settings)
    disk = FillingDisk(monkeypatch, budget=100)  # the merge's first write fills it
    assert maybe_finalize(settings, job_id) is False
    job = _job(settings, job_id)
    assert job.status == "finalizing" and job.status_detail == "storage_full: finalizing will retry"
    assert job.retry_at is not None and job.retry_at <= utcnow() + timedelta(seconds=settings.storage_retry_max_s)
    client = create_app(settings).test_client()
    from store.keys import create_key

    key, _ = create_key(settings, "default", name="t")
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"
    native = client.get(f"/v1/jobs/{job_id}").get_json()
    assert native["status_detail"] == "storage_full: finalizing will retry"
    batch = client.get(f"/v1/batches/{job_id}").get_json()
    assert batch["errors"]["data"] == [
        {"code": "storage_full", "message": "storage_full: finalizing will retry", "param": None, "line": None}
    ]
    assert OpenAIBatch.model_validate(batch, strict=True).errors.data[0].code == "storage_full"  # OpenAI's shape
    ui = _signed_in(client.application, key)
    shown = {j["id"]: j for j in ui.get("/ui/jobs.json").get_json()["jobs"]}[job_id]
    assert shown["status_detail"] == "storage_full: finalizing will retry"
    assert "status-detail" in ui.get("/ui/").get_data(as_text=True)  # the page renders it under the status
    printed = _cli_status(monkeypatch, native, capsys)
    assert f"job {job_id}: finalizing (storage_full: finalizing will retry)" in printed
    assert [name for _, _, names in os.walk(settings.storage_url) for name in names if ".tmp" in name] == []

    time.sleep(settings.storage_retry_max_s + 0.1)
    assert _finalize_finished_jobs(settings) == 0  # still full: given back again, not stuck on a claim
    assert _job(settings, job_id).storage_failures == 2
    disk.free()
    time.sleep(settings.storage_retry_max_s + 0.1)
    assert _finalize_finished_jobs(settings) == 1  # no ten-minute stale timeout: the next sweep after the backoff
    job = _job(settings, job_id)
    assert job.status == "completed" and job.status_detail is None and job.request_failed == 3
    assert client.get(f"/v1/jobs/{job_id}").get_json()["status_detail"] is None
    assert client.get(f"/v1/batches/{job_id}").get_json()["errors"] is None


def test_a_permanent_storage_failure_fails_the_job_with_a_clear_code(deployment, monkeypatch):
    settings = deployment
    job_id = _finished_job(settings)

    def denied(*_args, **_kwargs):
        raise PermissionError(errno.EACCES, "Permission denied: '/srv/storage/results'")

    monkeypatch.setattr(store.results.parts.ResultsStore, "merge", denied)
    assert maybe_finalize(settings, job_id) is False
    job = _job(settings, job_id)
    assert job.status == "failed" and job.status_detail is None
    assert job.errors[-1]["code"] == "storage_denied"
    assert "Permission denied" not in job.errors[-1]["message"] and "not allowed" in job.errors[-1]["message"]


def test_an_upload_while_full_answers_507_and_leaves_nothing(deployment, monkeypatch):
    from api.app import create_app
    from store.keys import create_key

    settings = deployment
    client = create_app(settings).test_client()
    key, _ = create_key(settings, "default", name="t")
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"
    FillingDisk(monkeypatch, budget=1000)
    body = jsonl([chat_line(f"u{i}", "x" * 200) for i in range(20)])  # ~5 KB: past the budget
    native = client.post("/v1/jobs?model=tiny", data=body, content_type="application/x-ndjson")
    assert native.status_code == 507, native.get_json()
    error = native.get_json()["error"]
    assert error["code"] == "storage_full" and "Errno" not in error["message"]
    assert native.headers["Retry-After"] == "30"
    upload = client.post("/v1/files", data={"purpose": "batch", "file": (__import__("io").BytesIO(body), "in.jsonl")})
    assert upload.status_code == 507, upload.get_json()
    with session_scope(settings.database_url) as s:
        assert s.query(File).count() == 0 and s.query(Job).count() == 0  # no file record, no job
    files = [f for _, _, names in os.walk(settings.storage_url) for f in names]
    assert files == []  # no bytes left behind, no temporary file


def test_a_validator_that_hits_a_full_disk_gives_back_and_resumes_after_the_backoff(deployment, monkeypatch):
    from api.app import create_app
    from store.keys import create_key
    from store.lifecycle.validating import claim_validation, run_validation, stale_validations

    settings = dataclasses.replace(deployment, shard_size=2)
    app = create_app(settings)
    client = app.test_client()
    key, _ = create_key(settings, "default", name="t")
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"
    sent = []
    body = jsonl([chat_line(f"v{i}", "hello") for i in range(6)])
    disk = FillingDisk(monkeypatch, budget=len(body) + 10)  # the upload fits, the shards do not
    created = client.post("/v1/jobs?model=tiny", data=body, content_type="application/x-ndjson")
    assert created.status_code == 201, created.get_json()
    job = validated(client, created)
    assert job["status"] == "validating" and job["status_detail"] == "storage_full: validation will retry"
    assert _job(settings, job["id"]).validation_owner is None  # the claim is given back at once
    assert stale_validations(settings) == []  # not before the backoff is over
    disk.free()
    time.sleep(settings.storage_retry_max_s + 0.1)
    assert stale_validations(settings) == [job["id"]]
    assert claim_validation(settings, job["id"], "resumer")
    run_validation(settings, job["id"], "resumer", sent.extend)
    job = client.get(f"/v1/jobs/{job['id']}").get_json()
    assert job["status"] == "in_progress" and job["status_detail"] is None and job["shards"] == 3
    assert len(sent) == 3
