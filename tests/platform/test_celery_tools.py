"""Celery's own tools work against a live pagedbatch worker: `celery -A workers.celery_app inspect ...` and Flower."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

from pagedbatch.client import Client
from tests.helpers import MODEL, REPO, free_port, jsonl, long_line, spawn


def celery(platform, *args: str) -> dict:
    """`celery -A workers.celery_app <args> --json`, on the platform's settings; its JSON answer."""
    env = {**os.environ, **platform.settings.to_env(), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "celery", "-A", "workers.celery_app", *args, "--timeout=5", "--json"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_celery_inspect_stats_and_active(live_url, worker, tmp_path):
    stats = celery(worker, "inspect", "stats")
    assert len(stats) == 1
    ((name, info),) = stats.items()
    assert name.startswith(f"{MODEL}-") and info["pool"]["max-concurrency"] == 4
    assert info["broker"]["transport"] == "redis"

    client = Client(live_url, api_key=worker.api_key)
    src = tmp_path / "in.jsonl"
    # twelve shards of 8 requests x 960 tokens: running long enough for a few `celery inspect` round trips
    src.write_bytes(jsonl([long_line(f"c-{i}", max_tokens=960) for i in range(96)]))
    job = client.submit(src, model=MODEL)
    deadline = time.monotonic() + 60
    running = []
    while not running and time.monotonic() < deadline:
        running = [task for tasks in celery(worker, "inspect", "active").values() for task in tasks]
    client.cancel(job["id"])
    assert running and {task["name"] for task in running} == {"pagedbatch.run_shard"}
    shard_ids = {f"{job['id']}.{i:05d}" for i in range(12)}
    assert all(len(task["args"]) == 1 and task["args"][0] in shard_ids for task in running)
    assert client.wait(job["id"], timeout=60, poll_s=0.2)["status"] == "cancelled"


def test_flower_lists_the_worker(worker, tmp_path):
    port = free_port()
    env = {**os.environ, **worker.settings.to_env(), "PYTHONPATH": str(REPO), "FLOWER_UNAUTHENTICATED_API": "true"}
    cmd = [sys.executable, "-m", "celery", "-A", "workers.celery_app", "flower", f"--port={port}"]
    cmd.append("--address=127.0.0.1")
    log = tmp_path / "flower.log"
    flower = spawn(cmd, log=log, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 60
        workers: dict = {}
        while not workers:
            assert flower.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/workers?refresh=1", timeout=20) as r:
                    workers = json.loads(r.read())
            except OSError:
                time.sleep(0.5)
        ((name, info),) = workers.items()
        assert name.startswith(f"{MODEL}-") and info["stats"]["pool"]["max-concurrency"] == 4
        assert [q["name"] for q in info["active_queues"]] == [worker.settings.queue_for(MODEL)]
    finally:
        flower.terminate()
        flower.wait(timeout=30)
