"""The schema's migrations (Alembic), and `upgrade`, which applies them (`pagedbatch migrate`)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from store.db import normalize_url

MIGRATIONS_DIR = Path(__file__).resolve().parent


def _config(database_url: str) -> Config:
    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", normalize_url(database_url).replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(_config(database_url), revision)


def script_heads() -> set[str]:
    """The head revisions this code's migrations lead to."""
    from alembic.script import ScriptDirectory

    return set(ScriptDirectory.from_config(_config("sqlite://")).get_heads())


def database_heads(database_url: str) -> set[str]:
    """The revisions the database is at (empty before the first migration)."""
    from alembic.migration import MigrationContext
    from sqlalchemy import create_engine

    engine = create_engine(normalize_url(database_url))
    try:
        with engine.connect() as conn:
            return set(MigrationContext.configure(conn).get_current_heads())
    finally:
        engine.dispose()


def wait_for_head(database_url: str, timeout_s: float, poll_s: float = 2.0) -> bool:
    """Wait until the database is at this code's head (someone else migrates it); False after `timeout_s`.

    An unreachable database counts as not there yet. This never migrates: on Kubernetes one Job migrates
    and every API and worker pod waits here (an initContainer), so no pod runs on an older schema."""
    import time

    from sqlalchemy.exc import SQLAlchemyError

    want, deadline = script_heads(), time.monotonic() + timeout_s
    while True:
        try:
            if database_heads(database_url) == want:
                return True
        except SQLAlchemyError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
