"""Results while a job runs: `GET /v1/jobs/{id}/results?after=CURSOR` gives every line exactly once, in the order
shards finished, however their commits interleave and even when a stale attempt rewrites a finished part."""

import io
import json
import secrets
import time
from datetime import timedelta

from sqlalchemy import update

from batchfile.errors import LineError
from store.db import session_scope
from store.models import File, Job, Shard, utcnow
from store.results.live import lines_after
from store.results.parts import results_store
from store.results.rows import error_row
from tests.helpers import MODEL, jsonl, long_line


def _job_with_shards(settings, shards: int, rows: int) -> str:
    job_id, now = f"batch_{secrets.token_hex(6)}", utcnow()
    with session_scope(settings.database_url) as s:
        s.add(File(id=f"file-{job_id}", tenant="default", purpose="batch", filename="in.jsonl", bytes=1,
                   storage_key="files/none.jsonl"))  # fmt: skip
        s.flush()
        s.add(Job(id=job_id, tenant="default", status="in_progress", input_file_id=f"file-{job_id}",
                  request_total=shards * rows, shard_count=shards, in_progress_at=now,
                  expires_at=now + timedelta(hours=24), on_invalid_lines="skip"))  # fmt: skip
        s.flush()
        for index in range(shards):
            s.add(Shard(id=f"{job_id}.{index:05d}", job_id=job_id, index=index, model=MODEL, status="running",
                        request_count=rows, input_key="x"))  # fmt: skip
    return job_id


def _seal(settings, job_id: str, index: int, rows: int, finished_at, reverse: bool = False) -> None:
    """The shard's part written (rows in finishing order, here reversed or not) and the shard marked done."""
    lines = range(index * rows + 1, (index + 1) * rows + 1)
    part = results_store(settings).write_part(job_id, f"{job_id}.{index:05d}", [
        error_row(LineError(line, f"c{line}", "invalid_request", "x"), created_at=finished_at)
        for line in (reversed(lines) if reverse else lines)
    ])  # fmt: skip
    with session_scope(settings.database_url) as s:
        s.execute(update(Shard).where(Shard.id == f"{job_id}.{index:05d}")
                  .values(status="done", part_key=part, finished_at=finished_at))  # fmt: skip


def test_the_cursor_gives_every_line_once_however_shards_commit(platform):
    settings, rows = platform.settings, 5
    job_id = _job_with_shards(settings, shards=4, rows=rows)
    now = utcnow()
    assert lines_after(settings, job_id, "0", 3) == ([], "0", False)  # nothing sealed yet
    _seal(settings, job_id, 2, rows, now)
    seen, cursor = [], "0"
    page, cursor, more = lines_after(settings, job_id, cursor, 3)  # part of shard 2
    seen += page
    assert more and [x["custom_id"] for x in page] == ["c11", "c12", "c13"]
    # shards 0 and 1 commit later with earlier finishing times (another worker's clock, a slow commit); a
    # stale attempt rewrites shard 2's part with the same lines in another order
    _seal(settings, job_id, 0, rows, now - timedelta(seconds=5))
    _seal(settings, job_id, 1, rows, now - timedelta(seconds=4))
    _seal(settings, job_id, 2, rows, now, reverse=True)
    page, cursor, more = lines_after(settings, job_id, cursor, 4)
    seen += page
    assert [x["custom_id"] for x in page[:2]] == ["c14", "c15"]  # the shard read part of is finished first
    while more:
        page, cursor, more = lines_after(settings, job_id, cursor, 4)
        seen += page
    assert lines_after(settings, job_id, cursor, 4) == ([], cursor, False)  # nothing new: the same cursor
    _seal(settings, job_id, 3, rows, now + timedelta(seconds=1))
    while True:
        page, cursor, more = lines_after(settings, job_id, cursor, 100)
        seen += page
        if not page:
            break
    ids = [x["custom_id"] for x in seen]
    assert sorted(ids, key=lambda c: int(c[1:])) == [f"c{line}" for line in range(1, 21)]  # each once
    assert all(x["response"]["body"]["error"]["code"] == "invalid_request" for x in seen)  # OpenAI's error lines


def test_a_cursor_this_api_did_not_give_is_a_404(client):
    job = client.post("/v1/jobs", data={"file": (io.BytesIO(jsonl([long_line("a")])), "in.jsonl"), "model": MODEL},
                      content_type="multipart/form-data").get_json()  # fmt: skip
    bad = client.get(f"/v1/jobs/{job['id']}/results?after=bm9wZQ")
    assert bad.status_code == 404 and bad.get_json()["error"]["param"] == "after"
    assert client.get(f"/v1/jobs/{job['id']}/results?after=a/b").status_code == 400


def test_a_consumer_polling_by_cursor_during_a_job_sees_every_line_once(client, worker):
    lines = [long_line(f"r-{i}", f"tell me about {i}", max_tokens=24) for i in range(96)]  # 12 shards of 8
    job = client.post("/v1/jobs", data={"file": (io.BytesIO(jsonl(lines)), "in.jsonl"), "model": MODEL},
                      content_type="multipart/form-data").get_json()  # fmt: skip
    seen, cursor, before_end, deadline = [], "0", 0, time.monotonic() + 300
    while time.monotonic() < deadline:
        page = client.get(f"/v1/jobs/{job['id']}/results?after={cursor}&limit=5").get_json()
        seen += page["data"]
        cursor = page["next_cursor"]
        if page["job_status"] not in ("completed", "failed", "cancelled", "expired"):
            before_end += len(page["data"])
        elif not page["has_more"]:
            break
        if not page["has_more"]:
            time.sleep(0.1)
    ids = [x["custom_id"] for x in seen]
    assert len(ids) == len(set(ids)) and set(ids) == {line["custom_id"] for line in lines}
    assert before_end > 0, "no line was read before the job ended"
    assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in seen)
    finished = client.get(f"/v1/jobs/{job['id']}/results?format=jsonl").data.decode().splitlines()
    by_id = {json.loads(x)["custom_id"]: json.loads(x)["response"]["body"] for x in finished}
    assert all(x["response"]["body"] == by_id[x["custom_id"]] for x in seen)  # the same results as at the end
