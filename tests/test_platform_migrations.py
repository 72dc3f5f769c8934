"""The schema: migrations upgrade a fresh database, and they agree with the SQLAlchemy models."""

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from store.db import normalize_url
from store.models import Base


def test_models_and_migrations_agree(platform):
    engine = create_engine(normalize_url(platform.settings.database_url))
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(context, Base.metadata)
            tables = set(inspect(conn).get_table_names())
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations differ; autogenerate would emit: {diff}"
    assert {"jobs", "files", "shards", "alembic_version"} <= tables


def test_migrate_is_idempotent(platform):
    from migrations import upgrade

    upgrade(platform.settings.database_url)  # already at head: nothing to do, no error


def test_shards_carry_no_error_column_nobody_reads(platform):
    """shards.error was written only on a split (which the worker logs) and read nowhere: the i36 migration
    drops it, and the model has no such attribute."""
    from store.models import Shard

    engine = create_engine(normalize_url(platform.settings.database_url))
    try:
        with engine.connect() as conn:
            columns = {c["name"] for c in inspect(conn).get_columns("shards")}
    finally:
        engine.dispose()
    assert "error" not in columns and "part_key" in columns
    assert not hasattr(Shard, "error")
