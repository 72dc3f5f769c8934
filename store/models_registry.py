"""The models running workers serve: each worker registers itself (model, path, endpoints, context length)
and renews a heartbeat; the API lists and validates against models with a fresh heartbeat.

`PAGEDBATCH_MODELS` (Settings.models) still works on the API as an override: a name configured there is
validated with the configured path, whatever a worker registered.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select, update

from settings import PlatformSettings, current
from store.db import session_scope
from store.models import WorkerModel, utcnow
from store.settings import Settings

HEARTBEAT_S = 10.0  # how often a worker renews its row (PAGEDBATCH_HEARTBEAT_S)
STALE_AFTER_BEATS = 3  # a worker whose last heartbeat is older than this many intervals is not running
FORGET_AFTER = timedelta(days=1)  # rows of workers that died without unregistering are removed after this


def heartbeat_s() -> float:
    return current(PlatformSettings).heartbeat_s


def fresh_after() -> timedelta:
    return timedelta(seconds=heartbeat_s() * STALE_AFTER_BEATS)


@dataclass(frozen=True)
class Registration:
    worker: str
    model: str
    path: str
    endpoints: tuple[str, ...]
    max_model_len: int
    hostname: str
    pid: int
    metrics_port: int | None = None
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters over the model: (name, directory)


@dataclass(frozen=True)
class RunningWorker:
    worker: str
    model: str
    path: str
    endpoints: list[str]
    max_model_len: int
    hostname: str
    pid: int
    metrics_port: int | None
    started_at: datetime
    heartbeat_at: datetime
    adapters: dict[str, str]


def register(settings: Settings, reg: Registration) -> None:
    """Insert or replace the worker's row, heartbeat now; also forget long-dead workers' rows."""
    now = utcnow()
    with session_scope(settings.database_url) as s:
        s.execute(delete(WorkerModel).where(WorkerModel.heartbeat_at < now - FORGET_AFTER))
        s.merge(
            WorkerModel(
                worker=reg.worker,
                model=reg.model,
                path=reg.path,
                endpoints=list(reg.endpoints),
                max_model_len=reg.max_model_len,
                hostname=reg.hostname,
                pid=reg.pid,
                metrics_port=reg.metrics_port,
                adapters=dict(reg.adapters),
                started_at=now,
                heartbeat_at=now,
            )
        )


def heartbeat(settings: Settings, worker: str, throughput: dict | None = None) -> bool:
    """Renew the worker's heartbeat, with its measured step rates (workers.host.step_rates) when given; False
    when its row is gone (then the caller registers again)."""
    values = {"heartbeat_at": utcnow()} | ({"throughput": throughput} if throughput is not None else {})
    with session_scope(settings.database_url) as s:
        result = s.execute(update(WorkerModel).where(WorkerModel.worker == worker).values(**values))
        return result.rowcount > 0


def unregister(settings: Settings, worker: str) -> None:
    with session_scope(settings.database_url) as s:
        s.execute(delete(WorkerModel).where(WorkerModel.worker == worker))


def running_workers(settings: Settings) -> list[RunningWorker]:
    """Workers whose heartbeat is fresh, by model then worker."""
    since = utcnow() - fresh_after()
    with session_scope(settings.database_url) as s:
        rows = s.scalars(
            select(WorkerModel).where(WorkerModel.heartbeat_at >= since).order_by(WorkerModel.model, WorkerModel.worker)
        ).all()
        return [
            RunningWorker(
                r.worker,
                r.model,
                r.path,
                list(r.endpoints),
                r.max_model_len,
                r.hostname,
                r.pid,
                r.metrics_port,
                r.started_at,
                r.heartbeat_at,
                dict(r.adapters or {}),
            )
            for r in rows
        ]


def worker_throughput(settings: Settings, model: str) -> list[dict]:
    """The measured step rates of the fresh workers serving `model` (those that have published any)."""
    since = utcnow() - fresh_after()
    query = select(WorkerModel.throughput).where(WorkerModel.model == model, WorkerModel.heartbeat_at >= since)
    with session_scope(settings.database_url) as s:
        return [dict(t) for t in s.scalars(query) if t]


def worker_count(settings: Settings, model: str | None) -> int:
    """Fresh workers serving `model` (every model's when None); at least 1, the one that will come."""
    return max(1, sum(1 for w in running_workers(settings) if model is None or w.model == model))


def running_models(settings: Settings) -> dict[str, RunningWorker]:
    """Model name -> the most recently started fresh worker serving it."""
    models: dict[str, RunningWorker] = {}
    for w in running_workers(settings):
        if w.model not in models or w.started_at > models[w.model].started_at:
            models[w.model] = w
    return models


def running_adapters(settings: Settings) -> dict[str, tuple[str, str]]:
    """LoRA adapters served over running models: {adapter name: (its base model, its directory)}."""
    return {name: (w.model, path) for w in running_models(settings).values() for name, path in w.adapters.items()}


def model_paths(settings: Settings) -> dict[str, str]:
    """The model directories validation loads tokenizers from: running models' registered paths, with
    `settings.models` (PAGEDBATCH_MODELS) overriding them and adding names no worker registered."""
    paths = {name: w.path for name, w in running_models(settings).items()}
    paths.update(settings.models)
    return paths
