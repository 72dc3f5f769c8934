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


def test_waiting_for_the_schema_head_waits_for_someone_else_to_migrate(platform):
    """The Kubernetes pods' initContainer (`pagedbatch migrate --wait`): it never migrates, it waits."""
    import os
    import subprocess
    import sys
    import threading
    import time

    from migrations import database_heads, script_heads, upgrade, wait_for_head
    from pagedbatch.embedded import create_database, drop_database
    from store.db import dispose_all
    from tests.helpers import REPO
    from tests.platform_fixtures import _database_url

    name = platform.db_name + "_wait"
    create_database(platform.admin_url, name)
    url = _database_url(platform.admin_url, name)
    env = {**os.environ, "PAGEDBATCH_DATABASE_URL": url}
    cli = [sys.executable, "-m", "pagedbatch", "migrate", "--wait", "0"]
    try:
        assert script_heads() and database_heads(url) == set()
        t0 = time.monotonic()
        assert not wait_for_head(url, 0.5, poll_s=0.1)
        assert time.monotonic() - t0 >= 0.5
        assert database_heads(url) == set(), "waiting migrated the database"
        done = subprocess.run(cli, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "not at schema" in done.stderr, done.stderr
        threading.Timer(1.0, upgrade, args=(url,)).start()
        assert wait_for_head(url, 60, poll_s=0.1)
        assert database_heads(url) == script_heads()
        done = subprocess.run(cli, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    finally:
        dispose_all()
        drop_database(platform.admin_url, name)
    assert not wait_for_head("postgresql://nobody@127.0.0.1:1/none", 0.3, poll_s=0.1)  # unreachable: not yet


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
