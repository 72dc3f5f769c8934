"""Worker roles for prefill/decode disaggregation (`pagedbatch worker --role`).

`both` (the default) is a worker as before. `decode` takes shards from the model's queue like
`both`, holds their leases and writes their rows, but sends each request's prefill to a live
prefill worker (`workers.remote_prefill`) and decodes from the KV it gets back; with none alive
it prefills locally. `prefill` takes no shards: it serves prefills to decode workers
(`workers.prefill_service`) and announces itself in Redis (`workers.prefill_registry`).

Settings (environment): PAGEDBATCH_KV_HOST (the address other hosts reach this one at; default
127.0.0.1, so one host only), PAGEDBATCH_PREFILL_IN_FLIGHT (8), PAGEDBATCH_KV_TIMEOUT_S (120: a
prefill that makes no progress this long, queueing included, falls back to a local prefill),
PAGEDBATCH_PREFILL_LIVENESS_S (3: a prefill worker silent this long is dead),
PAGEDBATCH_KV_MAX_SEND_MBPS (0 = no cap: a prefill worker's KV send rate, in megabits per second).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from workers.disagg_metrics import DisaggCollector
from workers.kv_zmq import ZmqTransport
from workers.prefill_registry import Heartbeat, PrefillRegistry
from workers.prefill_service import PrefillServer
from workers.remote_prefill import RemotePrefill

ROLES = ("both", "prefill", "decode")


def _kv_host() -> str:
    return os.environ.get("PAGEDBATCH_KV_HOST", "127.0.0.1")


def _bind() -> str:
    host = _kv_host()
    return f"tcp://{'127.0.0.1' if host in ('127.0.0.1', 'localhost') else '0.0.0.0'}:0"


def _registry(settings, model: str) -> PrefillRegistry:
    return PrefillRegistry.from_url(settings.broker_url, model,
                                    float(os.environ.get("PAGEDBATCH_PREFILL_LIVENESS_S", "3")))


def attach_remote_prefill(settings, model: str, host, metrics=None) -> RemotePrefill:
    """Make `host` (a decode worker's EngineHost) prefill on the prefill pool."""
    transport = ZmqTransport(_bind(), advertise_host=_kv_host())
    remote = RemotePrefill(host.engine, _registry(settings, model), transport,
                           max_in_flight=int(os.environ.get("PAGEDBATCH_PREFILL_IN_FLIGHT", "8")),
                           kv_timeout_s=float(os.environ.get("PAGEDBATCH_KV_TIMEOUT_S", "120")))
    host.remote_prefill = remote
    if metrics is not None:
        metrics.registry.register(DisaggCollector(model, remote=remote, engine=host.engine))
    return remote


def serve_prefill(settings, model: str, host, metrics=None) -> None:
    """Serve prefills for `model` from `host` until SIGTERM or SIGINT."""
    transport = ZmqTransport(_bind(), advertise_host=_kv_host(),
                             max_send_mbps=float(os.environ.get("PAGEDBATCH_KV_MAX_SEND_MBPS", "0")))
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
