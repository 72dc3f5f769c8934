"""`KVTransport` over TCP with ZeroMQ: each endpoint binds a ROUTER socket at its address and
receives there on a thread of its own; sending goes through one DEALER per peer, one message
per layer with zero-copy frames, so the sender never holds more than the bundle it already has
and the receiver sees a dead sender as a bundle that stops making progress. `max_send_mbps` caps
what one endpoint sends (so KV traffic leaves room on a shared network)."""

from __future__ import annotations

import threading
import time

import zmq

from engine.kv_transfer.export import KVBundle
from workers.disagg.kv_transport import KVTransport, bundle_messages


class ZmqTransport(KVTransport):
    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        advertise_host: str | None = None,
        context: zmq.Context | None = None,
        send_timeout_s: float = 30.0,
        max_send_mbps: float = 0.0,
        retry_after_s: float = 10.0,
    ):
        super().__init__()
        self.max_send_bytes_s = max_send_mbps * 1e6 / 8  # 0: unlimited
        self._ctx = context or zmq.Context.instance()
        self._recv = self._ctx.socket(zmq.ROUTER)
        self._recv.setsockopt(zmq.LINGER, 0)
        self._recv.bind(bind)
        endpoint = self._recv.getsockopt_string(zmq.LAST_ENDPOINT)
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.address = f"tcp://{advertise_host or host}:{port}"
        self._send_timeout_ms = int(send_timeout_s * 1000)
        self._peers: dict[str, zmq.Socket] = {}
        self._down: dict[str, float] = {}  # peer -> when a send to it last timed out
        self.retry_after_s = retry_after_s
        self._send_lock = threading.Lock()  # zmq sockets are not thread-safe
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-recv", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._recv, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._recv.recv_multipart(copy=False)[1:]  # drop the sender's identity
            if len(frames) >= 2:
                self.inbox.feed([f.buffer for f in frames])

    def _peer(self, worker: str) -> zmq.Socket:
        sock = self._peers.get(worker)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
            sock.setsockopt(zmq.SNDHWM, 64)  # messages (layers) queued per peer before send blocks
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not connected
            sock.connect(worker)
            self._peers[worker] = sock
        return sock

    def send(self, worker: str, request_id: str, bundle: KVBundle | None, reason: str = "") -> None:
        with self._send_lock:
            if time.monotonic() - self._down.get(worker, -1e9) < self.retry_after_s:
                raise ConnectionError(f"KV endpoint {worker} did not take the last send; skipping it for now")
            sock = self._peer(worker)
            started, sent = time.monotonic(), 0
            for msg in bundle_messages(request_id, bundle, reason):
                try:
                    sock.send_multipart(msg, copy=False)
                except zmq.Again:  # a dead or stuck receiver: drop what is queued for it, skip it a while
                    self._down[worker] = time.monotonic()
                    self._peers.pop(worker).close(linger=0)
                    raise ConnectionError(f"KV send to {worker} timed out") from None
                sent += sum(len(f) for f in msg[3:])
                if self.max_send_bytes_s:  # pace to the cap, one layer at a time
                    time.sleep(max(0.0, started + sent / self.max_send_bytes_s - time.monotonic()))
            self.bytes_sent += sent

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self._send_lock:
            for sock in self._peers.values():
                sock.close()
            self._peers.clear()
        self._recv.close()
