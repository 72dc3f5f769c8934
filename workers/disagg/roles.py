"""Worker roles for prefill/decode disaggregation (`pagedbatch worker --role`).

`both` (the default) is a worker as before. `decode` takes shards from the model's queue like
`both`, holds their leases and writes their rows, but sends each request's prefill to a live
prefill worker (`workers.disagg.remote_prefill`) and decodes from the KV it gets back; with none alive
it prefills locally. `prefill` takes no shards: it serves prefills to decode workers
(`workers.disagg.prefill_service`) and announces itself in Redis (`workers.disagg.prefill_registry`).

Settings (environment): PAGEDBATCH_KV_HOST (the address other hosts reach this one at; default
127.0.0.1, so one host only), PAGEDBATCH_PREFILL_IN_FLIGHT (8), PAGEDBATCH_KV_TIMEOUT_S (120: a
prefill that makes no progress this long, queueing included, falls back to a local prefill),
PAGEDBATCH_PREFILL_LIVENESS_S (3: a prefill worker silent this long is dead),
PAGEDBATCH_KV_MAX_SEND_MBPS (0 = no cap: a prefill worker's KV send rate, in megabits per second).
"""

from __future__ import annotations

import signal
import sys
import threading

from settings import WorkerSettings, current
from workers.disagg.kv_zmq import ZmqTransport
from workers.disagg.prefill_registry import Heartbeat, PrefillRegistry
from workers.disagg.prefill_service import PrefillServer
from workers.disagg.remote_prefill import RemotePrefill
from workers.metrics.disagg import DisaggCollector

ROLES = ("both", "prefill", "decode")


def _kv_host() -> str:
    return current(WorkerSettings).kv_host


def _bind() -> str:
    host = _kv_host()
    return f"tcp://{'127.0.0.1' if host in ('127.0.0.1', 'localhost') else '0.0.0.0'}:0"


def _registry(settings, model: str) -> PrefillRegistry:
    return PrefillRegistry.from_url(settings.broker_url, model, current(WorkerSettings).prefill_liveness_s)


def attach_remote_prefill(settings, model: str, host, metrics=None) -> RemotePrefill:
    """Make `host` (a decode worker's EngineHost) prefill on the prefill pool."""
    transport = ZmqTransport(_bind(), advertise_host=_kv_host())
    remote = RemotePrefill(
        host.engine,
        _registry(settings, model),
        transport,
        max_in_flight=current(WorkerSettings).prefill_in_flight,
        kv_timeout_s=current(WorkerSettings).kv_timeout_s,
    )
    host.remote_prefill = remote
    if metrics is not None:
        metrics.registry.register(DisaggCollector(model, remote=remote, engine=host.engine))
    return remote


def serve_prefill(settings, model: str, host, metrics=None) -> None:
    """Serve prefills for `model` from `host` until SIGTERM or SIGINT."""
    transport = ZmqTransport(_bind(), advertise_host=_kv_host(), max_send_mbps=current(WorkerSettings).kv_max_send_mbps)
    server = PrefillServer(host, transport, _bind(), advertise_host=_kv_host())
    if metrics is not None:
        metrics.registry.register(DisaggCollector(model, server=server))
    heartbeat = Heartbeat(_registry(settings, model), server.address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"pagedbatch worker: prefill for model {model} at {server.address} ready.", file=sys.stderr, flush=True)
    try:
        stop.wait()
    finally:
        heartbeat.stop()
        server.close()
        transport.close()
