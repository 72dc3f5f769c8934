"""The workers' Celery app: late acks, one queue per model name, a thread pool feeding one engine."""

from __future__ import annotations

from celery import Celery
from celery.signals import worker_shutting_down

from broker.queue import celery_config
from store.settings import Settings
from workers import tasks


def _on_worker_shutting_down(**_kwargs) -> None:
    tasks.on_shutdown()


def make_celery(settings: Settings) -> Celery:
    app = Celery("pagedbatch", set_as_current=True)
    app.conf.update(celery_config(settings))
    app.conf.update(worker_pool="threads", worker_enable_remote_control=False)
    tasks.register(app)
    worker_shutting_down.connect(_on_worker_shutting_down, weak=False)
    return app
