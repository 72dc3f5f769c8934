"""Whole-file prefix planning through the API (no worker: the shards are read back, not run), the quote of a
dry run, and a running job's estimated completion."""

from __future__ import annotations

import json
import random
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from store.db import session_scope
from store.filestore.storage import get_storage
from store.lifecycle.progress import Progress
from store.lifecycle.quotes import estimated_completion
from store.models import IN_PROGRESS, Job, Shard, utcnow
from tests.helpers import MODEL, completion_line, jsonl, validated

GROUPS, PER_GROUP, SHARED = 3, 4, 32  # 3 prompts of 2 full blocks, each shared by 4 lines


@pytest.fixture
def planning(platform):
    app = platform.app(queue_prefix="pbtest-noworker-plans", plan_window_lines=1000, shard_size=8)
    return app.test_client(), app.extensions["pagedbatch"].settings


def _lines() -> list[dict]:
    rng = random.Random(3)
    systems = [[rng.randrange(10, 90) for _ in range(SHARED)] for _ in range(GROUPS)]
    lines = [
        completion_line(f"g{g}-{i}", systems[g] + [rng.randrange(10, 90) for _ in range(5)], max_tokens=3)
        for g in range(GROUPS)
        for i in range(PER_GROUP)
    ]
    rng.shuffle(lines)
    return lines


def _post(client, path: str, lines: list[dict]):
    return client.post(path, data=jsonl(lines), content_type="application/x-ndjson")


def _shards(settings, job_id) -> list[list[str]]:
    storage = get_storage(settings.storage_url)
    with session_scope(settings.database_url) as s:
        keys = list(s.scalars(select(Shard.input_key).where(Shard.job_id == job_id).order_by(Shard.index)))
    shards = []
    for key in keys:
        with storage.open_read(key) as f:
            shards.append([json.loads(x)["custom_id"] for x in f if x.strip()])
    return shards


def test_lines_sharing_a_prefix_share_a_shard_and_the_plan_is_reported(planning):
    client, settings = planning
    job = validated(client, _post(client, f"/v1/jobs?model={MODEL}", _lines()))
    shards = _shards(settings, job["id"])
    assert sorted(len(s) for s in shards) == [4, 8]  # whole groups, at most 8 lines a shard
    for shard in shards:  # each group's lines together, in one shard
        groups = [cid.split("-")[0] for cid in shard]
        assert groups == sorted(groups, key=groups.index) and len(set(groups)) == len(shard) // PER_GROUP
    prompt = GROUPS * PER_GROUP * (SHARED + 5)
    assert job["plan"] == {
        "prompt_tokens": prompt,
        "expected_cached_tokens": GROUPS * (PER_GROUP - 1) * SHARED,  # each prefix computed once
        "max_completion_tokens": GROUPS * PER_GROUP * 3,
        "cached_tokens": 0,
    }


def test_a_dry_run_quotes_the_plan_and_creates_nothing(planning):
    client, settings = planning
    with session_scope(settings.database_url) as s:
        before = s.scalar(select(func.count()).select_from(Job))
    r = _post(client, f"/v1/jobs?model={MODEL}&dry_run=true", [*_lines(), {"custom_id": "bad"}])
    assert r.status_code == 200, r.get_json()
    quote = r.get_json()
    assert quote["object"] == "job.quote" and quote["lines"] == GROUPS * PER_GROUP and quote["invalid_lines"] == 1
    assert quote["prompt_tokens"] == GROUPS * PER_GROUP * (SHARED + 5)
    assert quote["expected_cached_tokens"] == GROUPS * (PER_GROUP - 1) * SHARED
    assert quote["max_completion_tokens"] == GROUPS * PER_GROUP * 3 and quote["shards"] == 2
    with session_scope(settings.database_url) as s:
        assert s.scalar(select(func.count()).select_from(Job)) == before
    unknown = _post(client, "/v1/jobs?model=nope&dry_run=true", _lines())
    assert unknown.status_code == 400


def test_estimated_completion_follows_the_live_rate():
    now = utcnow()
    job = Job(status=IN_PROGRESS, in_progress_at=now - timedelta(seconds=100), expires_at=now + timedelta(hours=1))
    done = Progress(25, 0, 0, 0, 0, requests_done=25, requests_valid=100)
    assert estimated_completion(job, done, now) == now + timedelta(seconds=300)  # 75 left at 0.25/s
    assert estimated_completion(job, Progress(0, 0, 0, 0, 0, 0, 100), now) is None  # no rate yet
