"""The workers' Celery app: late acks, one queue per model name, a thread pool feeding one engine.

`celery -A workers.celery_app inspect active` (or `stats`, `ping`, ...) and Flower find the app as this
module's `app`, built from the PAGEDBATCH_* environment when first asked for; workers answer remote control.
"""

from __future__ import annotations

from celery import Celery
from celery.signals import worker_shutting_down

from broker.queue import celery_config
from store.settings import Settings
from workers import tasks


def _on_worker_shutting_down(how: str = "Warm", **_kwargs) -> None:
    tasks.on_shutdown(how)


def make_celery(settings: Settings) -> Celery:
    app = Celery("pagedbatch", set_as_current=True)
    app.conf.update(celery_config(settings))
    app.conf.update(worker_pool="threads", worker_enable_remote_control=True)
    tasks.register(app)
    worker_shutting_down.connect(_on_worker_shutting_down, weak=False)
    return app


def __getattr__(name: str) -> Celery:
    """`app`: the Celery app of the environment's settings, for Celery's command line and Flower."""
    if name != "app":
        raise AttributeError(name)
    app = make_celery(Settings.from_env())
    globals()["app"] = app
    return app
