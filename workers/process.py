"""One worker process: load the engine, then run a Celery worker on the model's queue until shutdown."""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable

from engine import LLMEngine
from store.settings import Settings
from store.storage_health import StorageCollector
from workers import disagg, tasks
from workers.cancel import CancelWatcher
from workers.celery_app import make_celery
from workers.engine_host import EngineHost
from workers.metrics import WorkerMetrics
from workers.priority import BOOKKEEPING_NICE, lower_this_thread
from workers.registration import Heartbeat, registration_for


def load_engine_factory(spec: str | None) -> Callable[..., object]:
    """`module:callable` -> that callable; None -> `engine.LLMEngine`.

    The callable gets LLMEngine's keyword arguments (model=..., device=..., ...) and returns an
    engine: LLMEngine itself, a subclass, or any object with the same step API.
    """
    if not spec:
        return LLMEngine
    module, sep, name = spec.partition(":")
    if not (module and sep and name):
        raise ValueError(f"bad engine factory {spec!r}; expected module:callable")
    return functools.reduce(getattr, name.split("."), importlib.import_module(module))


def celery_argv(queue: str, hostname: str, *, concurrency: int, loglevel: str) -> list[str]:
    """A thread pool sharing the one engine; with late acks and a prefetch of one, the worker holds
    no more shards than it runs."""
    return [
        "worker",
        "--pool=threads",
        f"--concurrency={concurrency}",
        f"--queues={queue}",
        f"--hostname={hostname}",
        f"--loglevel={loglevel}",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "--prefetch-multiplier=1",
    ]


def run_worker(
    settings: Settings,
    model_name: str,
    model_path: str,
    *,
    engine_kwargs: dict,
    engine_factory: str | None = None,
    concurrency: int = 4,
    loglevel: str = "info",
    bookkeeping_nice: int = BOOKKEEPING_NICE,
    metrics_port: int | None = None,
    role: str = "both",
    drain_s: float = 0.0,
) -> None:
    """Serve `model_name`'s queue with one engine loaded from `model_path`, until SIGTERM or SIGINT
    (`role`: see workers.disagg; a prefill worker serves decode workers instead of the queue; `drain_s`:
    how long running shards may finish after SIGTERM before they are handed back, see `tasks.on_shutdown`)."""
    factory = load_engine_factory(engine_factory)
    host = EngineHost(lambda: factory(model=model_path, **engine_kwargs))
    if bookkeeping_nice:  # every thread started from here on yields to the engine's
        lower_this_thread(bookkeeping_nice)
    metrics = None
    if metrics_port is not None:
        metrics = WorkerMetrics(model_name)
        metrics.watch(host)
        metrics.registry.register(StorageCollector(settings))
        metrics.serve(metrics_port)
    if role == "prefill":
        try:
            return disagg.serve_prefill(settings, model_name, host, metrics)
        finally:
            host.close()
    if role == "decode":
        disagg.attach_remote_prefill(settings, model_name, host, metrics)
    watcher = CancelWatcher(settings, host)
    tasks.configure(settings, host, watcher, metrics, drain_s=drain_s)
    registration = registration_for(
        model_name, model_path, max_model_len=engine_kwargs.get("max_model_len"), metrics_port=metrics_port
    )
    heartbeat = Heartbeat(settings, registration)  # /v1/models lists this model while it beats
    queue = settings.queue_for(model_name)
    print(
        f"pagedbatch worker: model {model_name} from {model_path}, queue {queue}, role {role}, "
        f"engine loop thread {host.loop_thread_id}"
        + (f", metrics on port {metrics_port}" if metrics_port is not None else ""),
        file=sys.stderr,
    )
    try:
        make_celery(settings).worker_main(
            celery_argv(queue, registration.worker, concurrency=concurrency, loglevel=loglevel)
        )
    finally:
        heartbeat.close()
        watcher.close()
        host.close()
