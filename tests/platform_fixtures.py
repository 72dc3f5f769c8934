"""Fixtures for the platform tests: real PostgreSQL and Redis, a real Celery worker process, a live API.

PostgreSQL and Redis are the running services when they answer (URLs from PAGEDBATCH_TEST_POSTGRES_URL
and PAGEDBATCH_TEST_REDIS_URL, defaulting to 127.0.0.1), else embedded ones started here. Each test
session gets its own database (created and dropped) and its own Redis key prefix and queue names.

conftest.py registers these fixtures for every test module (`pytest_plugins`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedbatch.embedded import (
    LOCAL_POSTGRES,
    LOCAL_REDIS,
    create_database,
    drop_database,
    servers_or_embedded,
)
from store.settings import Settings
from tests.helpers import MODEL, REPO, free_port, spawn

OTHER_TENANT = "other"


def _services(tmp: Path):
    """(admin postgres URL, redis URL, things to stop) for this session."""
    return servers_or_embedded(
        tmp,
        os.environ.get("PAGEDBATCH_TEST_POSTGRES_URL", LOCAL_POSTGRES),
        os.environ.get("PAGEDBATCH_TEST_REDIS_URL", LOCAL_REDIS),
    )


def _database_url(admin_url: str, name: str) -> str:
    base, _, query = admin_url.partition("?")
    base = base.rsplit("/", 1)[0] + "/" + name
    return base + ("?" + query if query else "")


class Harness:
    def __init__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="pagedbatch-test-"))
        self.admin_url, self.redis_url, self._stops = _services(self.tmp)
        token = secrets.token_hex(4)
        self.db_name = f"pagedbatch_test_{token}"
        create_database(self.admin_url, self.db_name)
        from engine.testing.tiny import write_tiny_model

        self.model_path = str(write_tiny_model(self.tmp / "tiny-model", arch="qwen3"))
        self.settings = Settings(
            database_url=_database_url(self.admin_url, self.db_name),
            broker_url=self.redis_url,
            storage_url=str(self.tmp / "storage"),
            models={MODEL: self.model_path},
            shard_size=8,
            plan_window_lines=1,  # shards written as validated (planned a shard at a time); plan tests widen it
            broker_prefix=f"pbtest-{token}:",
            queue_prefix=f"pbtest-{token}",
            cancel_poll_s=0.1,
            # tests leave many jobs unfinished (queues nobody serves); limits are tested with their own
            max_active_jobs_per_tenant=0,
            max_queued_requests_per_tenant=0,
            webhook_allow_loopback=True,  # like `serve`, the test platform serves its own machine (receivers on it)
            webhook_retry_base_s=0.5,
        )
        from migrations import upgrade

        upgrade(self.settings.database_url)
        self._keys: dict[str, str] = {}
        self.api_key = self.key_for(self.settings.default_tenant)  # tenant "default"
        self.other_key = self.key_for(OTHER_TENANT)
        self._worker: subprocess.Popen | None = None
        self.metrics_port: int | None = None  # the worker's Prometheus port
        self._server = None
        self.base_url: str | None = None
        self._lock = threading.Lock()

    # ---- a real worker process --------------------------------------------------------------

    def start_worker(self, concurrency: int = 4, timeout: float = 120) -> None:
        with self._lock:
            if self._worker is not None and self._worker.poll() is None:
                return
            log = self.tmp / "worker.log"
            self.metrics_port = free_port()
            env = {**os.environ, **self.settings.to_env(), "PYTHONUNBUFFERED": "1"}
            self._worker = spawn(
                [
                    sys.executable,
                    "-m",
                    "pagedbatch",
                    "worker",
                    "--model",
                    f"{MODEL}={self.model_path}",
                    f"--concurrency={concurrency}",
                    "--loglevel=info",
                    "--device=cpu",
                    f"--metrics-port={self.metrics_port}",
                    "--log-format=json",
                ],
                cwd=REPO,
                env=env,
                log=log,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                text = log.read_text(errors="replace") if log.exists() else ""
                if " ready." in text:
                    return
                if self._worker.poll() is not None:
                    raise RuntimeError(f"worker exited with {self._worker.returncode}:\n{text[-4000:]}")
                time.sleep(0.2)
            raise RuntimeError(f"worker not ready after {timeout}s:\n{log.read_text()[-4000:]}")

    def worker_log(self) -> str:
        log = self.tmp / "worker.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def stop_worker(self) -> None:
        if self._worker is not None and self._worker.poll() is None:
            self._worker.terminate()
            try:
                self._worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._worker.kill()
        self._worker = None

    # ---- API keys ---------------------------------------------------------------------------

    def key_for(self, tenant: str) -> str:
        """An API key of `tenant`, made once per session."""
        if tenant not in self._keys:
            from store.keys import create_key

            self._keys[tenant], _ = create_key(self.settings, tenant, name="tests")
        return self._keys[tenant]

    def auth(self, tenant: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key_for(tenant or self.settings.default_tenant)}"}

    # ---- a live API server ------------------------------------------------------------------

    def app(self, **overrides):
        """The app on these settings; its test_client() sends a key of the settings' default_tenant
        (so `app(default_tenant="t1")` acts as tenant t1). `FlaskClient(app)` sends none."""
        from flask.testing import FlaskClient

        from api.app import create_app

        settings = dataclasses.replace(self.settings, **overrides)
        app = create_app(settings)
        key = self.key_for(settings.default_tenant)

        class KeyedClient(FlaskClient):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"

        app.test_client_class = KeyedClient
        return app

    def start_server(self) -> str:
        with self._lock:
            if self.base_url is None:
                from werkzeug.serving import make_server

                self._server = make_server("127.0.0.1", 0, self.app(), threaded=True)
                threading.Thread(target=self._server.serve_forever, daemon=True).start()
                self.base_url = f"http://127.0.0.1:{self._server.server_port}"
            return self.base_url

    def close(self) -> None:
        self.stop_worker()
        if self._server is not None:
            self._server.shutdown()
        from store.db import dispose_all

        dispose_all()
        with contextlib.suppress(Exception):
            drop_database(self.admin_url, self.db_name)
        with contextlib.suppress(Exception):
            from broker.queue import purge_prefix

            purge_prefix(self.settings)
        for stop in reversed(self._stops):
            with contextlib.suppress(Exception):
                stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def platform() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.close()


@pytest.fixture
def client(platform):
    """A Flask test client on the platform's settings."""
    return platform.app().test_client()


@pytest.fixture(scope="session")
def worker(platform) -> Harness:
    platform.start_worker()
    return platform


@pytest.fixture(scope="session")
def live_url(platform) -> str:
    return platform.start_server()
