"""Alembic environment: the target metadata is the job store's models."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from settings import PlatformSettings, current
from store.db import normalize_url
from store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or current(PlatformSettings).database_url
    if not url:
        raise RuntimeError("no database URL; set PAGEDBATCH_DATABASE_URL")
    return normalize_url(url)


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def _run_on(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")  # a caller may lend its own connection
    if connection is not None:
        _run_on(connection)
        return
    engine = create_engine(_url())
    with engine.connect() as connection:
        _run_on(connection)
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
