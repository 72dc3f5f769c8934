"""The broker side the API needs: Celery settings shared with the workers, and enqueueing by task name.

The API never imports `workers`; it sends `RUN_SHARD` by name to the model's queue.
"""

from __future__ import annotations

import threading

from celery import Celery
from kombu import Connection
from kombu.exceptions import ChannelError

from settings import PlatformSettings, current
from store.settings import Settings

RUN_SHARD = "pagedbatch.run_shard"
# How long Redis keeps a delivered, unacknowledged message before handing it to another worker. Shards are
# protected by their leases (workers.sweeper), so a short value only costs redeliveries that are skipped.
VISIBILITY_TIMEOUT_S = 6 * 3600

_lock = threading.Lock()
_apps: dict[tuple[str, str], Celery] = {}


def celery_config(settings: Settings) -> dict:
    visibility = current(PlatformSettings).visibility_timeout_s
    transport_options: dict = {"visibility_timeout": visibility}
    if visibility < 600:  # a short timeout: look for timed-out messages often (kombu: every 100s)
        transport_options.update(unacked_restore_interval=max(1, int(visibility)), unacked_restore_throttle=1)
    if settings.broker_prefix:
        transport_options["global_keyprefix"] = settings.broker_prefix
    return {
        "broker_url": settings.broker_url,
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "task_serializer": "json",
        "accept_content": ["json"],
        "worker_hijack_root_logger": False,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
    }


def celery_client(settings: Settings) -> Celery:
    """A Celery app for sending tasks (one per broker URL and prefix, per process)."""
    if not settings.broker_url:
        raise RuntimeError("no broker configured; set PAGEDBATCH_BROKER_URL")
    key = (settings.broker_url, settings.broker_prefix)
    with _lock:
        app = _apps.get(key)
        if app is None:
            app = Celery("pagedbatch-client", set_as_current=False)
            app.conf.update(celery_config(settings))
            _apps[key] = app
        return app


def enqueue_shards(settings: Settings, shards: list[tuple[str, str]]) -> None:
    """Send one RUN_SHARD task per (shard id, model name) to that model's queue."""
    app = celery_client(settings)
    with app.producer_or_acquire() as producer:
        for shard_id, model in shards:
            app.send_task(RUN_SHARD, args=[shard_id], queue=settings.queue_for(model), producer=producer)


def queue_size(settings: Settings, model: str) -> int:
    """Messages waiting in a model's queue (0 when the queue does not exist, e.g. after a Redis restart).

    Counted with the Redis channel's LLEN: kombu's passive queue_declare checks the queue with an EXISTS
    that misses the global key prefix (kombu 5.7), so under PAGEDBATCH_BROKER_PREFIX it found no queue."""
    app = celery_client(settings)
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        if hasattr(channel, "_size"):  # kombu's Redis channel
            return int(channel._size(settings.queue_for(model)))
        try:
            return int(channel.queue_declare(queue=settings.queue_for(model), passive=True).message_count)
        except ChannelError:
            return 0


def purge_prefix(settings: Settings) -> int:
    """Delete every broker key under `settings.broker_prefix` (tests and benchmarks clean up with this)."""
    if not settings.broker_prefix:
        raise ValueError("refusing to purge without a broker_prefix")
    with Connection(settings.broker_url) as conn:  # no key prefix on this client: patterns are literal
        client = conn.default_channel.client
        keys = list(client.scan_iter(match=settings.broker_prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
        return len(keys)
