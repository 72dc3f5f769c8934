"""One worker process: load the engine, then run a Celery worker on the model's queue until shutdown."""

from __future__ import annotations

import sys

from engine.runner.gc_heap import freeze_loaded_heap
from settings import WorkerSettings, current, export, is_set
from store.filestore.storage_health import StorageCollector
from store.settings import Settings
from workers import tasks
from workers.cancel import CancelWatcher
from workers.celery_app import make_celery
from workers.disagg import roles as disagg
from workers.host import lora_adapters
from workers.host.engine_factory import load_engine_factory
from workers.host.engine_host import EngineHost
from workers.host.engine_process import EngineProcess
from workers.metrics.series import WorkerMetrics
from workers.priority import BOOKKEEPING_NICE, lower_this_thread
from workers.registration import Heartbeat, registration_for


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
    loras: dict[str, str] | None = None,
) -> None:
    """Serve `model_name`'s queue with one engine loaded from `model_path`, until SIGTERM or SIGINT
    (`role`: see workers.disagg.roles; a prefill worker serves decode workers instead of the queue; `drain_s`:
    how long running shards may finish after SIGTERM before they are handed back, see `tasks.on_shutdown`;
    `loras`: {name: directory} of the LoRA adapters served over the model, lines name them as their model)."""
    lora_adapters.configure(loras or {})
    # pagedbatch_kernels.startup: ready for shards at once, the kernels compiled when the engine is first idle
    if not is_set("PAGEDBATCH_STARTUP"):
        export("PAGEDBATCH_STARTUP", "deferred")
    if role == "both" and current(WorkerSettings).engine_process:
        host = EngineProcess(engine_factory, model_path, engine_kwargs)
    else:
        factory = load_engine_factory(engine_factory)
        host = EngineHost(lambda: factory(model=model_path, **engine_kwargs))
    freeze_loaded_heap()  # the engine lives as long as this process: its objects need no more collecting
    # every thread started from here on yields to the engine's; an engine in a process of its own keeps its
    # interpreter lock to itself, and shard threads that yielded their CPU too would starve its batch
    if bookkeeping_nice and not isinstance(host, EngineProcess):
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
        model_name,
        model_path,
        max_model_len=engine_kwargs.get("max_model_len"),
        metrics_port=metrics_port,
        adapters=loras,
    )
    # /v1/models lists this model while it beats; each beat publishes the measured step rates (quotes, ETAs)
    heartbeat = Heartbeat(settings, registration, throughput=host.rates.snapshot)
    queue = settings.queue_for(model_name)
    print(
        f"pagedbatch worker: model {model_name} from {model_path}, queue {queue}, role {role}, "
        f"engine loop thread {host.loop_thread_id}"
        + (f" in engine process {host.engine_pid}" if isinstance(host, EngineProcess) else "")
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
