"""The prefill worker (`pagedbatch worker --role prefill`): a service decode workers call.

It takes no shards. A decode worker sends [b"P", R, its KV address, request JSON] to the ROUTER
socket this service binds (and announces in Redis, `workers.disagg.prefill_registry`); the request runs
in this worker's engine as a prefill-only request, and its KV bundle goes to the decode worker's
address through the `KVTransport` ([b"X", R, why] instead when the first token already ended it,
the engine refused it, or the queue is full: the decode worker then prefills it itself).
[b"C", R, address] aborts R. Nothing here is durable: the decode worker holds the shard's lease,
so a prefill worker that dies loses no work, only time.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time

import zmq

from engine.params.sampling_params import SamplingParams
from workers.disagg.kv_transport import KVTransport

log = logging.getLogger(__name__)

REMOTE_DECODE = {"do_remote_decode": True}


def encode_prefill_request(prompt_token_ids: list[int], params: dict, skip_blocks: int = 0) -> bytes:
    """`skip_blocks`: leading full blocks the decode worker already holds (its prefix cache); not sent."""
    return json.dumps({"prompt_token_ids": prompt_token_ids, "params": params, "skip_blocks": skip_blocks}).encode()


class PrefillServer:
    def __init__(
        self,
        host,
        transport: KVTransport,
        bind: str = "tcp://127.0.0.1:0",
        advertise_host: str | None = None,
        max_pending: int = 256,
        context: zmq.Context | None = None,
    ):
        self.host, self.transport, self.max_pending = host, transport, max_pending
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(bind)
        endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://")
        self.address = f"tcp://{advertise_host or endpoint.rsplit(':', 1)[0]}:{endpoint.rsplit(':', 1)[1]}"
        self._pending: dict[str, tuple[str, str]] = {}  # host request id -> (R, reply address)
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self.stats = {"requests": 0, "exported": 0, "refused": 0, "bytes_sent": 0, "send_seconds": 0.0}
        self._threads = [
            threading.Thread(target=self._serve, name="prefill-serve", daemon=True),
            threading.Thread(target=self._send_loop, name="prefill-send", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()[1:]
            try:
                self._handle(frames)
            except Exception:  # one bad message must not stop the service
                log.exception("bad prefill message %r", frames[:2])

    def _handle(self, frames: list[bytes]) -> None:
        kind, rid, reply_to = frames[0], frames[1].decode(), frames[2].decode()
        key = f"{reply_to}|{rid}"
        if kind == b"C":
            self.host.abort([key])
            return
        if kind != b"P":
            raise ValueError(f"unknown kind {kind!r}")
        with self._lock:
            busy = len(self._pending) >= self.max_pending or key in self._pending
            if not busy:
                self._pending[key] = (rid, reply_to)
        self.stats["requests"] += 1
        if busy:
            self._outbox.put((key, rid, reply_to, None, "the prefill worker is busy"))
            return
        body = json.loads(frames[3])
        params = SamplingParams(**body["params"])
        transfer = {**REMOTE_DECODE, "skip_blocks": int(body.get("skip_blocks", 0))}
        params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": transfer}
        future = self.host.submit(key, {"prompt_token_ids": body["prompt_token_ids"]}, params)
        future.add_done_callback(lambda f: self._outbox.put((key, rid, reply_to, f, "")))

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            try:
                key, rid, reply_to, future, why = self._outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            bundle = None
            if future is not None:
                with self._lock:
                    self._pending.pop(key, None)
                if future.exception() is not None:
                    why = f"{type(future.exception()).__name__}: {future.exception()}"
                elif future.result() is None:
                    why = "aborted"
                else:
                    bundle = future.result().kv_export
                    why = "" if bundle is not None else "finished on the prefill side"
            started = time.perf_counter()
            if bundle is not None:
                log.info("sending KV of %s (%d bytes) to %s", rid, bundle.nbytes, reply_to)
            try:
                self.transport.send(reply_to, rid, bundle, why)
            except (ConnectionError, zmq.ZMQError) as exc:
                log.warning("KV of %s to %s not sent: %s", rid, reply_to, exc)
                continue
            if bundle is not None:
                self.stats["exported"] += 1
                self.stats["bytes_sent"] += bundle.nbytes
                self.stats["send_seconds"] += time.perf_counter() - started
            else:
                self.stats["refused"] += 1

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        self._sock.close()
