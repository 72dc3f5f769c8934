"""Moving a prefilled request's KV from a prefill worker to a decode worker.

The interface is three calls: `send(worker, request_id, bundle)` ships R's blocks to the worker
at address W, layer by layer (or, with `bundle=None`, says R will not come); the receiving side
`expect(R)`s it, `receive(R)` waits for the whole bundle, and `release(R)` forgets whatever it
holds of R. A bundle is only handed out complete and well-formed: a sender that dies mid-way
leaves a partial bundle that `receive` never returns (it times out, or `alive()` says the peer is
gone) and `release` drops. Frames for a request nobody expects are dropped, so what a receiver
buffers is bounded by what it asked for.

Messages (lists of byte frames): [b"H", R, header], [b"L", R, layer, K, V] per layer, [b"E", R]
at the end, [b"X", R, reason] instead of a bundle. `InProcessTransport` delivers them by function
call (tests); `workers.disagg.kv_zmq.ZmqTransport` over TCP.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from engine.kv_transfer.export import KVBundle
from engine.kv_transfer.wire import KVAssembler, encode_header, layer_buffers


def bundle_messages(request_id: str, bundle: KVBundle | None, reason: str = ""):
    """The messages that carry `bundle` (a generator: one layer is built at a time)."""
    rid = request_id.encode()
    if bundle is None:
        yield [b"X", rid, reason.encode()]
        return
    yield [b"H", rid, encode_header(bundle)]
    for i in range(len(bundle.layers)):
        yield [b"L", rid, str(i).encode(), *layer_buffers(bundle, i)]
    yield [b"E", rid]


class _Slot:
    def __init__(self):
        self.assembler: KVAssembler | None = None
        self.result: KVBundle | None = None
        self.failed: str | None = None
        self.last_progress = time.monotonic()


class Inbox:
    """The receiving half shared by the transports: feed it messages, wait for bundles."""

    def __init__(self):
        self._slots: dict[str, _Slot] = {}
        self._cond = threading.Condition()
        self.bytes_received = 0

    def expect(self, request_id: str) -> None:
        with self._cond:
            self._slots[request_id] = _Slot()

    def feed(self, frames: list) -> None:
        kind, rid = bytes(frames[0]), bytes(frames[1]).decode()
        with self._cond:
            slot = self._slots.get(rid)
            if slot is None or slot.result is not None or slot.failed:
                return  # not asked for, or already settled
            slot.last_progress = time.monotonic()
            try:
                self._apply(slot, kind, frames)
            except (ValueError, KeyError, IndexError) as exc:
                slot.failed, slot.assembler = f"bad KV message: {exc}", None
            self._cond.notify_all()

    def _apply(self, slot: _Slot, kind: bytes, frames: list) -> None:
        if kind == b"H":
            slot.assembler = KVAssembler(frames[2])
        elif kind == b"L":
            if slot.assembler is None:
                raise ValueError("layer before header")
            slot.assembler.add_layer(int(bytes(frames[2])), frames[3], frames[4])
            self.bytes_received += len(frames[3]) + len(frames[4])
        elif kind == b"E":
            if slot.assembler is None:
                raise ValueError("end before header")
            slot.result, slot.assembler = slot.assembler.bundle(), None
        elif kind == b"X":
            slot.failed = bytes(frames[2]).decode() or "not exported"
        else:
            raise ValueError(f"unknown message kind {kind!r}")

    def receive(
        self, request_id: str, timeout: float, alive: Callable[[], bool] = lambda: True, poll_s: float = 0.2
    ) -> tuple[KVBundle | None, str | None]:
        """(bundle, None) once complete; (None, why) if refused, malformed, silent for `timeout`
        seconds, or `alive()` turns False. The slot stays until `release`."""
        with self._cond:
            while True:
                slot = self._slots.get(request_id)
                if slot is None:
                    return None, "released"
                if slot.result is not None:
                    return slot.result, None
                if slot.failed:
                    return None, slot.failed
                if time.monotonic() - slot.last_progress > timeout:
                    return None, f"no KV progress for {timeout:g} s"
                if not alive():
                    return None, "the sender is gone"
                self._cond.wait(poll_s)

    def release(self, request_id: str) -> None:
        with self._cond:
            self._slots.pop(request_id, None)
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._slots)


class KVTransport:
    """One endpoint: receives at `address`, sends to other endpoints' addresses."""

    address: str

    def __init__(self):
        self.inbox = Inbox()
        self.bytes_sent = 0

    def send(self, worker: str, request_id: str, bundle: KVBundle | None, reason: str = "") -> None:
        raise NotImplementedError

    def expect(self, request_id: str) -> None:
        self.inbox.expect(request_id)

    def receive(self, request_id: str, timeout: float = 60.0, alive: Callable[[], bool] = lambda: True):
        return self.inbox.receive(request_id, timeout, alive)

    def release(self, request_id: str) -> None:
        self.inbox.release(request_id)

    def close(self) -> None:
        pass


class InProcessTransport(KVTransport):
    """Endpoints in one process, found by address in a shared registry (a dict)."""

    def __init__(self, address: str, registry: dict):
        super().__init__()
        self.address, self._registry = address, registry
        registry[address] = self

    def send(self, worker: str, request_id: str, bundle: KVBundle | None, reason: str = "") -> None:
        peer = self._registry.get(worker)
        if peer is None:
            raise ConnectionError(f"no KV endpoint at {worker!r}")
        for msg in bundle_messages(request_id, bundle, reason):
            self.bytes_sent += sum(len(f) for f in msg[3:])
            peer.inbox.feed(msg)  # the receiver copies the buffers it keeps

    def close(self) -> None:
        self._registry.pop(self.address, None)
