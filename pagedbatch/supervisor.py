"""`pagedbatch serve`: the whole platform on one machine, started and stopped together.

PostgreSQL and Redis run embedded in the data directory unless PAGEDBATCH_DATABASE_URL /
PAGEDBATCH_BROKER_URL name servers; the API runs in this process and one worker process per model
runs beside it, with every engine option `serve` was given. A worker that dies is started again
(`pagedbatch.restarter`), with a backoff, and `serve` says so on stderr.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

from api.app import create_app
from api.server_errors import make_json_error_server
from migrations import upgrade
from pagedbatch.embedded import EmbeddedPostgres, EmbeddedRedis
from pagedbatch.engine_options import engine_argv
from pagedbatch.restarter import Restarter
from settings import PlatformSettings, child_environment, current
from store.keys import ensure_local_key, local_key_path
from store.settings import Settings, home_dir


def worker_command(name: str, path: str, args, metrics_port: int | None = None) -> list[str]:
    """The command line of the worker that `serve` starts for one model."""
    return [
        sys.executable,
        "-m",
        "pagedbatch",
        "worker",
        "--model",
        f"{name}={path}",
        f"--concurrency={args.concurrency}",
        *engine_argv(args),
        *([f"--metrics-port={metrics_port}"] if metrics_port is not None else []),
        "--loglevel=warning",
    ]


def worker_metrics_ports(args, count: int) -> list[int | None]:
    """`serve --metrics-port PORT`: the workers' Prometheus ports, PORT, PORT+1, ... in model order."""
    base = getattr(args, "metrics_port", None)
    return [None if base is None else base + i for i in range(count)]


def start_embedded(settings: Settings, home: Path) -> list:
    """Start PostgreSQL and Redis in `home` where settings name none, and point settings at them."""
    services = []
    if not settings.database_url:
        postgres = EmbeddedPostgres(home / "pgdata")
        services.append(postgres)
        settings.database_url = postgres.database_url("pagedbatch")
    if not settings.broker_url:
        redis = EmbeddedRedis(home / "redis.db")
        services.append(redis)
        settings.broker_url = redis.url
    return services


def announce_local_key(settings: Settings, home: Path) -> str:
    """Create (first start) or reuse `serve`'s API key, saved in the data dir, and say where it is."""
    key, created = ensure_local_key(settings, home)
    where = local_key_path(home)
    if created:
        print(
            f"pagedbatch: created an API key for tenant {settings.default_tenant!r}: {key}\n"
            f"pagedbatch: it is saved in {where}; clients on this machine use it by default "
            "(or send it as Authorization: Bearer, --api-key or PAGEDBATCH_API_KEY)",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(f"pagedbatch: using the API key saved in {where}", file=sys.stderr, flush=True)
    return key


def _exit_on_signal(signum, frame):
    raise SystemExit(0)


def serve(args, settings: Settings) -> int:
    home = Path(args.data_dir).expanduser() if args.data_dir else home_dir()
    home.mkdir(parents=True, exist_ok=True)
    if not settings.models:
        raise SystemExit("pagedbatch serve: give at least one --model NAME=PATH")
    if not current(PlatformSettings).storage_url:
        settings.storage_url = str(home / "storage")
    if "webhook_allow_loopback" not in current(PlatformSettings).model_fields_set:
        settings.webhook_allow_loopback = True  # one machine: its own receivers are the ones to call
    services = start_embedded(settings, home)
    workers = Restarter()
    try:
        upgrade(settings.database_url)
        announce_local_key(settings, home)
        env = child_environment(settings.to_env())
        ports = worker_metrics_ports(args, len(settings.models))
        for (name, path), port in zip(settings.models.items(), ports):
            command = worker_command(name, path, args, port)
            workers.add(f"worker for model {name!r}", lambda command=command: subprocess.Popen(command, env=env))
        server = make_json_error_server(args.host, args.port, create_app(settings))
        signal.signal(signal.SIGTERM, _exit_on_signal)
        print(
            f"pagedbatch serving on http://{args.host}:{server.server_port} "
            f"(models: {', '.join(settings.models)}; data in {home})",
            file=sys.stderr,
            flush=True,
        )
        try:
            with contextlib.suppress(KeyboardInterrupt):
                server.serve_forever()
        finally:
            server.server_close()
    finally:
        workers.stop()
        for service in reversed(services):
            service.stop()
    return 0
