"""The worker's engine host in a process of its own (`PAGEDBATCH_ENGINE_PROCESS=on`).

In one process, the shard threads' Python (reading inputs, preparing requests, building rows and Parquet
parts, the database) and the engine loop share one interpreter lock, so on a small machine most of the
shard work lands between the engine's steps instead of beside them. Here a child process runs an
ordinary `EngineHost` (fair share, failure isolation, the loop thread) and this process keeps a stand-in
with the same calls: `submit_many` and `abort` go down a pipe, each request's outcome comes back and
resolves its future here. The child ends when this process does (a parent-death signal, and end of file
on the pipe); a child that dies ends this process too, with the child's exit status, as an engine that
cannot go on does in one process.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from workers.host.fair_share import check_weight

log = logging.getLogger(__name__)


@dataclass
class _Ready:
    tokenizer: object
    max_model_len: int
    loop_thread_id: int | None
    pid: int
    load: object  # the engine's load when it was ready


class _Reported:
    """What the child reports with each step, read here as the in-process host's are read: `host.engine.load()`
    (the metrics' gauges) and `host.rates.snapshot()` (the heartbeat's step rates)."""

    def __init__(self, load):
        self.latest_load, self.latest_rates = load, {}

    def load(self):
        return self.latest_load

    def snapshot(self) -> dict:
        return dict(self.latest_rates)


class EngineProcess:
    """`EngineHost`'s calls, served by an `EngineHost` in a spawned child built from `factory_spec`
    (`module:callable`, or None for LLMEngine) with `model` and `engine_kwargs`."""

    def __init__(self, factory_spec: str | None, model: str, engine_kwargs: dict):
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(child_conn, factory_spec, model, engine_kwargs), name="engine", daemon=True
        )
        self._process.start()
        child_conn.close()
        try:
            ready = _recv(self._conn)
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the engine process exited with {self._process.exitcode} while loading") from None
        if isinstance(ready, BaseException):
            self._process.join()
            raise ready
        self.tokenizer = ready.tokenizer
        if self.tokenizer is None:  # the engine's would not pickle: the same directory's, loaded here
            from engine.hf.tokenizer import decoding_tokenizer

            self.tokenizer = decoding_tokenizer(engine_kwargs.get("tokenizer") or model)
        self.max_model_len = ready.max_model_len
        self.loop_thread_id = ready.loop_thread_id
        self.engine_pid = ready.pid
        self._reported = _Reported(ready.load)
        self.engine = self.rates = self._reported  # what the metrics and the heartbeat read
        self.observer = None  # told of every step (workers.metrics.series.WorkerMetrics), when set
        self.remote_prefill = None  # disaggregated roles keep the engine in the worker's process
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="engine-results", daemon=True)
        self._reader.start()

    def submit(self, request_id: str, prompt, params) -> Future:
        return self.submit_many([(request_id, prompt, params)])[0]

    def submit_many(self, requests, tenant: str = "default", *, weight=None, priority: int = 0, deadline=None):
        if weight is not None:
            weight = check_weight(weight)
        futures = []
        with self._lock:
            for request_id, _, _ in requests:
                if request_id in self._futures:
                    raise ValueError(f"request {request_id!r} is already running")
            for request_id, _, _ in requests:
                future: Future = Future()
                self._futures[request_id] = future
                futures.append(future)
        try:
            self._send(("submit", list(requests), tenant, weight, priority, deadline))
        except BaseException:
            with self._lock:
                for request_id, _, _ in requests:
                    self._futures.pop(request_id, None)
            raise
        return futures

    def abort(self, request_ids) -> int:
        """Resolves the requests' futures with None at once; the child frees their blocks."""
        with self._lock:
            found = [(rid, f) for rid in request_ids if (f := self._futures.pop(rid, None)) is not None]
        if found:
            self._send(("abort", [rid for rid, _ in found]))
        for _, future in found:
            future.set_result(None)
        return len(found)

    def pending(self) -> int:
        with self._lock:
            return len(self._futures)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # the child is gone already
            self._send(("close",))
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()

    def _send(self, message) -> None:
        with self._send_lock:
            _send(self._conn, message)

    def _read(self) -> None:
        while True:
            try:
                batch = _recv(self._conn)
            except (EOFError, OSError):
                break
            done = []
            for kind, *rest in batch:
                if kind == "step":
                    elapsed, load, rates = rest
                    self._reported.latest_load, self._reported.latest_rates = load, rates
                    if self.observer is not None:
                        self.observer.step_done((), elapsed)
                elif kind == "failed":
                    if self.observer is not None:
                        self.observer.step_failed(rest[0])
                else:
                    request_id, outcome, is_error = rest
                    with self._lock:
                        future = self._futures.pop(request_id, None)
                    if future is None:  # aborted here already
                        continue
                    if is_error:
                        future.set_exception(outcome)
                    else:
                        future.set_result(outcome)
                        if outcome is not None:
                            done.append(outcome)
            if done and self.observer is not None:
                self.observer.step_done(done, None)
        if not self._closed:
            self._process.join(timeout=5)
            code = self._process.exitcode
            log.critical("the engine process ended (exit status %s); ending this worker", code)
            logging.shutdown()
            os._exit(code if code and code > 0 else 70)


def _send(conn, message) -> None:
    """Plain pickle, not multiprocessing's: tensors (embeddings) travel as bytes, not as shared memory."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


# ---- the child --------------------------------------------------------------------------------------


class _Forwarder:
    """The child host's observer: each step's time and the engine's load go up with the results."""

    def __init__(self, host, outbox: queue.SimpleQueue):
        self.host, self.outbox = host, outbox

    def step_done(self, _outputs, elapsed: float) -> None:
        self.outbox.put(("step", elapsed, self.host.engine.load(), self.host.rates.snapshot()))

    def step_failed(self, exc: BaseException) -> None:
        self.outbox.put(("failed", _picklable(exc)))


def _pickles(obj) -> bool:
    try:
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return True
    except Exception:
        return False


def _picklable(exc: BaseException) -> BaseException:
    return exc if _pickles(exc) else RuntimeError(f"{type(exc).__name__}: {exc}")


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child_main(conn, factory_spec, model: str, engine_kwargs: dict) -> None:
    _die_with_parent()
    # the worker decides when the engine stops (a terminal's Ctrl-C reaches the whole process group)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from engine.runner.gc_heap import freeze_loaded_heap
    from workers.host.engine_factory import load_engine_factory
    from workers.host.engine_host import EngineHost

    try:
        factory = load_engine_factory(factory_spec)
        host = EngineHost(lambda: factory(model=model, **engine_kwargs))
    except BaseException as exc:
        _send(conn, _picklable(exc))
        return
    freeze_loaded_heap()
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    host.observer = _Forwarder(host, outbox)
    tokenizer = host.tokenizer if _pickles(host.tokenizer) else None
    _send(conn, _Ready(tokenizer, host.max_model_len, host.loop_thread_id, os.getpid(), host.engine.load()))
    threading.Thread(target=_send_outbox, args=(conn, outbox), name="engine-outbox", daemon=True).start()
    while True:
        try:
            message = _recv(conn)
        except (EOFError, OSError):
            os._exit(0)  # the worker is gone
        kind = message[0]
        if kind == "submit":
            _, requests, tenant, weight, priority, deadline = message
            try:
                futures = host.submit_many(requests, tenant, weight=weight, priority=priority, deadline=deadline)
            except Exception as exc:  # refused whole (an id still running here): each request fails
                for request_id, _, _ in requests:
                    outbox.put(("done", request_id, _picklable(exc), True))
                continue
            for (request_id, _, _), future in zip(requests, futures):
                future.add_done_callback(lambda f, rid=request_id: outbox.put(_outcome(rid, f)))
        elif kind == "abort":
            host.abort(message[1])
        elif kind == "close":
            host.close()
            outbox.put(None)
            return


def _outcome(request_id: str, future: Future) -> tuple:
    exc = future.exception()
    if exc is not None:
        return ("done", request_id, _picklable(exc), True)
    return ("done", request_id, future.result(), False)


def _sendable(item: tuple) -> tuple:
    if _pickles(item):
        return item
    if item[0] != "done":
        return ("failed", RuntimeError("a step report could not be pickled"))
    return ("done", item[1], RuntimeError("the request's output could not be pickled"), True)


def _send_outbox(conn, outbox: queue.SimpleQueue) -> None:
    """Everything waiting goes up in one message: a step's results travel together."""
    while True:
        item = outbox.get()
        batch = []
        while item is not None:
            batch.append(item)
            try:
                item = outbox.get_nowait()
            except queue.Empty:
                break
        if batch:
            try:
                data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # an output that cannot travel fails its own request only
                data = pickle.dumps([_sendable(i) for i in batch], protocol=pickle.HIGHEST_PROTOCOL)
            conn.send_bytes(data)
        if item is None:
            conn.close()
            return
