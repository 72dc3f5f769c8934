"""The decode worker's side of disaggregation: prefill a request on a prefill worker and import
its KV into this worker's engine (used by `workers.host.engine_host.EngineHost` when set).

Pacing: a request is sent out only while what is already in flight (and waiting in the engine to be
imported) leaves room in this engine's free KV blocks, and at most `max_in_flight` at once; so KV is
never produced faster than this worker can hold it, and what it buffers is bounded. Recovery: a
prefill that fails, is refused, stalls for `kv_timeout_s` (queueing on the prefill worker included),
or whose worker stops heartbeating falls back to prefilling here; a bundle is imported only whole.
With no live prefill worker, requests run here as on a `both` worker.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import zmq

from engine.core.block_manager import cdiv
from engine.core.contract import StepEngine
from engine.params.sampling_params import SamplingParams
from workers.disagg.kv_transport import KVTransport
from workers.disagg.prefill_registry import PrefillRegistry
from workers.disagg.prefill_service import encode_prefill_request

log = logging.getLogger(__name__)


def _params_json(params: SamplingParams) -> dict | None:
    """The params that differ from the defaults, if they are plain JSON (else None: run locally)."""
    default = SamplingParams()
    out = {
        f.name: getattr(params, f.name)
        for f in dataclasses.fields(SamplingParams)
        if f.init and getattr(params, f.name) != getattr(default, f.name)
    }
    try:
        json.dumps(out)
    except (TypeError, ValueError):
        return None
    return out


class RemotePrefill:
    def __init__(
        self,
        engine: StepEngine,
        registry: PrefillRegistry,
        transport: KVTransport,
        max_in_flight: int = 8,
        kv_timeout_s: float = 120.0,
        context: zmq.Context | None = None,
    ):
        self.engine, self.registry, self.transport = engine, registry, transport
        self.max_in_flight, self.kv_timeout_s = max_in_flight, kv_timeout_s
        self._ctx = context or zmq.Context.instance()
        self._sockets: dict[str, tuple[zmq.Socket, threading.Lock]] = {}
        self._waiting: deque = deque()
        self._in_flight: dict[tuple[str, int], int] = {}  # (request id, ticket) -> KV blocks it will need
        # request id -> the ticket of its current start; a fetch whose ticket is no longer current
        # (the request was aborted, maybe started again) hands nothing back
        self._tickets: dict[str, int] = {}
        self._ticket = itertools.count()
        self._live: list[str] = []
        self._live_at = 0.0
        self._next = 0
        self._lock = threading.Condition()
        self._pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="remote-prefill")
        self._stop = threading.Event()
        self.stats = {"remote": 0, "local_fallbacks": 0, "kv_bytes": 0, "transfer_seconds": 0.0}
        self._thread = threading.Thread(target=self._dispatch, name="prefill-dispatch", daemon=True)
        self._thread.start()

    def live_workers(self) -> list[str]:
        now = time.monotonic()
        if now - self._live_at > 0.5:
            try:
                self._live = self.registry.live()
            except Exception:  # Redis trouble: assume none, prefill here
                self._live = []
            self._live_at = now
        return self._live

    def start(self, request_id: str, prompt, params: SamplingParams, done) -> bool:
        """Take the request for a remote prefill; `done(request_id, bundle or None)` is called later
        (None: prefill it locally). False: not for a remote prefill, run it here now."""
        # n > 1, prompt logprobs and a grammar's matcher state do not travel with the KV: run those here
        if (
            params.n != 1
            or params.prompt_logprobs is not None
            or params.structured_outputs is not None
            or not isinstance(prompt, dict)
            or "prompt_token_ids" not in prompt
            or not self.live_workers()
        ):
            return False
        body = _params_json(params)
        if body is None:
            return False
        ids = list(prompt["prompt_token_ids"])
        blocks = cdiv(len(ids) + 1, self.engine.block_size)
        with self._lock:
            ticket = self._tickets[request_id] = next(self._ticket)
            self._waiting.append((request_id, ids, body, blocks, done, ticket))
            self._lock.notify_all()
        return True

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._waiting = deque(w for w in self._waiting if w[0] != request_id)
            self._tickets.pop(request_id, None)

    def _room(self, blocks: int) -> bool:
        pending = self.engine.num_pending_imports()
        if len(self._in_flight) + pending >= self.max_in_flight:
            return False
        return not self._in_flight or sum(self._in_flight.values()) + blocks <= self.engine.num_free_blocks()

    def _dispatch(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if not self._waiting or not self._room(self._waiting[0][3]):
                    self._lock.wait(0.05)
                    continue
                item = self._waiting.popleft()
                self._in_flight[item[0], item[5]] = item[3]
            self._pool.submit(self._fetch, *item)

    def _socket(self, worker: str):
        with self._lock:
            return self._sockets.get(worker) or self._new_socket(worker)

    def _new_socket(self, worker: str):
        if worker not in self._sockets:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 5000)
            sock.connect(worker)
            self._sockets[worker] = (sock, threading.Lock())
        return self._sockets[worker]

    def _send(self, worker: str, frames: list[bytes]) -> None:
        sock, lock = self._socket(worker)
        with lock:
            sock.send_multipart(frames)

    def _current(self, request_id: str, ticket: int) -> bool:
        return self._tickets.get(request_id) == ticket

    def _fetch(self, request_id: str, ids: list[int], body: dict, blocks: int, done, ticket: int) -> None:
        bundle, why, worker = None, "no live prefill worker", None
        transfer = f"{request_id}#{ticket}"  # unique per attempt: a late message of an aborted one is dropped
        started = time.perf_counter()
        try:
            live = self.live_workers()
            if live:
                worker = live[self._next % len(live)]
                self._next += 1
                self.transport.expect(transfer)
                tid = transfer.encode()
                skip = self.engine.num_cached_blocks(ids)  # a hint: import checks again
                request = encode_prefill_request(ids, body, skip)
                self._send(worker, [b"P", tid, self.transport.address.encode(), request])

                def alive() -> bool:
                    return self._current(request_id, ticket) and worker in self.live_workers()

                bundle, why = self.transport.receive(transfer, self.kv_timeout_s, alive)
                if bundle is None:  # aborted or given up on: the prefill worker may drop it too
                    self._send(worker, [b"C", tid, self.transport.address.encode()])
        except Exception as exc:  # any failure: prefill here instead
            bundle, why = None, f"{type(exc).__name__}: {exc}"
        finally:
            self.transport.release(transfer)
            with self._lock:
                self._in_flight.pop((request_id, ticket), None)
                current = self._current(request_id, ticket)
                if current:
                    del self._tickets[request_id]
                self._lock.notify_all()
        if not current:
            return
        if bundle is None:
            self.stats["local_fallbacks"] += 1
            log.info("remote prefill of %s on %s failed (%s); prefilling it here", request_id, worker, why)
        else:
            self.stats["remote"] += 1
            self.stats["kv_bytes"] += bundle.nbytes
            self.stats["transfer_seconds"] += time.perf_counter() - started
        done(request_id, bundle)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for sock, _ in self._sockets.values():
            sock.close()
