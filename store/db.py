"""Database engines and sessions, one engine per URL per process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker

_lock = threading.Lock()
_engines: dict[str, Engine] = {}
_sessionmakers: dict[str, sessionmaker] = {}


def normalize_url(url: str) -> str:
    """Use psycopg 3 for plain postgres URLs."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def get_engine(url: str) -> Engine:
    if not url:
        raise RuntimeError("no database configured; set PAGEDBATCH_DATABASE_URL")
    url = normalize_url(url)
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            engine = create_engine(url, pool_recycle=1800, pool_size=10, max_overflow=40, pool_pre_ping=True)
            _engines[url] = engine
            _sessionmakers[url] = sessionmaker(engine, expire_on_commit=False)
        return engine


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    get_engine(url)
    session = _sessionmakers[normalize_url(url)]()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def dispose_all() -> None:
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()
        _sessionmakers.clear()
