"""The platform on loopback for the benchmarks: PostgreSQL and Redis (the local ones, else embedded), a
fresh database, one `pagedbatch worker` and the API under gunicorn, and a `stop` that undoes it all."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def spawn(cmd: list[str], log, **kwargs) -> subprocess.Popen:
    """Start `cmd` with its output going to the file `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **kwargs)


def stop_processes(procs: list[subprocess.Popen], timeout: float = 30) -> None:
    """SIGTERM to all, then wait for each; one still running after `timeout` is killed."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()


def wait_until_ready(base: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(base + "/healthz", timeout=2)
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("API did not come up")


@dataclass
class Stack:
    url: str
    settings: object  # store.settings.Settings
    stop: Callable[[], None]


def own_deployment(tmp: Path, models: dict[str, str], **settings):
    """(Settings, cleanups) of a deployment of this run's own: a fresh, migrated database and Redis prefixes on
    the PostgreSQL and Redis that answer here (embedded ones otherwise), storage under `tmp`."""
    from migrations import upgrade
    from pagedbatch.embedded import create_database, drop_database, servers_or_embedded
    from store.settings import Settings

    admin, broker, stops = servers_or_embedded(tmp)
    token = secrets.token_hex(4)
    db = f"pagedbatch_bench_{token}"
    create_database(admin, db)
    stops.append(lambda: drop_database(admin, db))
    base, _, query = admin.partition("?")
    cfg = Settings(
        database_url=base.rsplit("/", 1)[0] + "/" + db + ("?" + query if query else ""),
        broker_url=broker,
        storage_url=str(tmp / "storage"),
        models=models,
        broker_prefix=f"pbbench-{token}:",
        queue_prefix=f"pbbench-{token}",
        **settings,
    )
    upgrade(cfg.database_url)
    return cfg, stops


def start_stack(
    tmp: Path,
    model: str,
    model_path: str,
    *,
    port: int,
    concurrency: int,
    api_workers: int,
    workers: int = 1,
    worker_args: tuple[str, ...] = (),
    **settings,
) -> Stack:
    """Start the stack serving `model_path` as `model` with `workers` worker processes (`worker_args`: more of
    their flags); `settings` override Settings fields (shard_size, max_lines, ...). Database, Redis keys and
    queues are this run's own."""
    cfg, stops = own_deployment(tmp, {model: model_path}, **settings)
    env = {**os.environ, **cfg.to_env()}
    procs = [
        spawn(
            [
                sys.executable,
                "-m",
                "pagedbatch",
                "worker",
                "--model",
                f"{model}={model_path}",
                f"--concurrency={concurrency}",
                "--loglevel=info",
                *worker_args,
            ],
            env=env,
            cwd=REPO,
            log=tmp / ("worker.log" if n == 0 else f"worker-{n}.log"),
        )
        for n in range(workers)
    ] + [
        spawn(
            [
                sys.executable,
                "-m",
                "pagedbatch",
                "api",
                "--host",
                "127.0.0.1",
                f"--port={port}",
                f"--workers={api_workers}",
                "--threads=16",
            ],
            env=env,
            cwd=REPO,
            log=tmp / "api.log",
        ),
    ]

    def stop() -> None:
        stop_processes(procs)
        from broker.queue import purge_prefix
        from store.db import dispose_all

        dispose_all()
        purge_prefix(cfg)
        for fn in reversed(stops):
            try:
                fn()
            except Exception as exc:
                print(f"(cleanup: {exc})", file=sys.stderr)

    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(url)
        deadline = time.monotonic() + 180
        for n in range(workers):
            worker_log = tmp / ("worker.log" if n == 0 else f"worker-{n}.log")
            while not worker_log.exists() or b" ready." not in worker_log.read_bytes():
                if time.monotonic() > deadline or procs[n].poll() is not None:
                    raise RuntimeError("worker did not come up:\n" + worker_log.read_text()[-3000:])
                time.sleep(0.2)
    except BaseException:
        stop()
        raise
    return Stack(url, cfg, stop)
