"""One engine per worker process, driven by a background thread; callers get per-request futures.

Many shard tasks (threads) submit into the same engine, so each step batches requests from many
shards and jobs. `abort` frees a request's blocks at once and resolves its future with None.

A step that raises must not take down the batch, the worker or the other requests. The engine cannot
say which request made it fail, so the host finds out by bisection: every request that was in the
engine is aborted and run again in halves (new submissions wait meanwhile); a half that fails again is
split again, and a request that fails alone is the culprit: its future gets the exception. A transient
fault (every half succeeds) fails nobody. Each failure costs a recomputation of the suspects.

Requests enter the engine by fair share across tenants (`workers.host.fair_share`): they wait in the host, one
queue per tenant (ordered by the job's priority), and the loop admits them as the engine has room. An engine
built with scheduling_policy="priority" also gets each request's priority.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future

from engine.core.contract import StepEngine, require_step_engine
from engine.params.pooling_params import PoolingParams
from engine.params.sampling_params import SamplingParams
from engine.runner.gc_heap import freeze_what_startup_added
from workers.host.fair_share import FairShare, check_weight
from workers.host.step_rates import StepRates

log = logging.getLogger(__name__)
STARTUP_IDLE_S = 2.0  # idle this long, a deferred start compiles its kernels (between shards, not in one)


class EngineHost:
    """Builds the engine with `factory` (no arguments) in a background thread and steps it there only.

    On CPU this matters: OpenMP (libgomp) keeps a team of threads for every thread that ever ran a
    parallel region, and once the process holds more of them than there are cores, every team stops
    spin-waiting and sleeps between regions. An engine loaded in the main thread and stepped in
    another ran about 40 % slower for that reason alone.
    """

    def __init__(self, factory, idle_wait_s: float = 0.05):
        self.engine: StepEngine | None = None  # used only through engine.core.contract.StepEngine
        self.idle_wait_s = idle_wait_s
        self._futures: dict[str, Future] = {}
        self._requests: dict[str, tuple] = {}  # request id -> (prompt, params, priority), to run it again
        self._in_engine: dict[str, None] = {}  # an ordered set: the latest admitted last
        self._held: list[str] = []  # submitted while a failure is being isolated
        self._tenant_of: dict[str, str] = {}
        self._fair = FairShare(enabled=False)  # set once the engine is loaded (its capacity)
        self._engine_priority = False  # whether the engine takes priorities (its scheduling_policy)
        self._suspects: deque[list[str]] = deque()  # groups still to run on their own
        self._group: set[str] | None = None  # the suspects running now
        self._paused_any = False  # some requests are paused in the engine (fair share's time slicing)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.loop_thread_id: int | None = None  # the loop thread's native id, once it runs
        self.observer = None  # told of every step (workers.metrics.series.WorkerMetrics), when set
        self.rates = StepRates()  # measured throughput, published by the registry heartbeat
        self.remote_prefill = None  # a decode worker's workers.disagg.remote_prefill.RemotePrefill, when set
        self._load_error: BaseException | None = None
        self._idle_since: float | None = None  # when the engine last ran out of work
        self._startup_finished = False
        self._thread = threading.Thread(target=self._run, args=(factory,), name="engine-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    def _run(self, factory) -> None:
        self.loop_thread_id = threading.get_native_id()
        try:
            self.engine = require_step_engine(factory())
            self._fair = FairShare.from_env(self.engine.max_num_seqs)
            self._engine_priority = self.engine.takes_priority
        except BaseException as exc:  # raised again in the constructor
            self._load_error = exc
            return
        finally:
            self._ready.set()
        self._loop()

    @property
    def tokenizer(self):
        """For the results' token texts: the engine's tokenizer without transformers where it has one."""
        return self.engine.decoding_tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def submit(self, request_id: str, prompt, params) -> Future:
        """Add a request; the future resolves to its RequestOutput (None if aborted).

        Bad input resolves the future with the engine's ValueError instead of raising here.
        """
        return self.submit_many([(request_id, prompt, params)])[0]

    def submit_many(
        self,
        requests,
        tenant: str = "default",
        *,
        weight: float | None = None,
        priority: int = 0,
        deadline: float | None = None,
    ) -> list[Future]:
        """Add (request_id, prompt, params) requests of `tenant` at once, so that they enter the same step
        rather than trickling into the batch one step at a time. `weight`: the tenant's fair-share weight
        (None: unchanged); `priority`: their job's (lower first within the tenant), then `deadline` (its
        completion window's end, Unix seconds: earliest first)."""
        if weight is not None:
            weight = check_weight(weight)  # before any request is taken
        prepared = [self._prepare(prompt, params) for _, prompt, params in requests]
        futures = []
        with self._lock:
            for (request_id, prompt, params), ready in zip(requests, prepared):
                if request_id in self._futures:
                    raise ValueError(f"request {request_id!r} is already running")
                future: Future = Future()
                futures.append(future)
                if isinstance(ready, Exception):  # bad input fails alone, before it takes a place
                    future.set_exception(ready)
                    continue
                self._futures[request_id] = future
                self._requests[request_id] = (prompt, params, priority, ready)
                self._tenant_of[request_id] = tenant
                if self._fair.enabled:
                    self._fair.push(tenant, request_id, priority, weight, deadline)
                elif self._isolating():
                    self._held.append(request_id)
                else:
                    self._add(request_id)
        self._wake.set()
        return futures

    def abort(self, request_ids) -> int:
        aborted = 0
        for request_id in request_ids:
            with self._lock:
                future = self._futures.pop(request_id, None)
                self._requests.pop(request_id, None)
                self._tenant_of.pop(request_id, None)
                in_engine = request_id in self._in_engine
                self._in_engine.pop(request_id, None)
            if future is None:
                continue
            if in_engine and self.remote_prefill is not None:
                self.remote_prefill.cancel(request_id)
            if in_engine:
                try:
                    self.engine.abort_request(request_id)
                except Exception:
                    log.exception("abort of %s failed", request_id)
            future.set_result(None)
            aborted += 1
        return aborted

    def pending(self) -> int:
        with self._lock:
            return len(self._futures)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- the loop (one thread) --------------------------------------------------------------

    def _isolating(self) -> bool:
        return self._group is not None or bool(self._suspects)

    def _admit(self) -> Counter | None:
        """Fair share: move waiting requests into the engine while it has room (not while isolating). Returns
        how many requests each tenant has in the engine then (None while isolating)."""
        with self._lock:
            if self._isolating():
                return None
            running = Counter(self._tenant_of.get(rid) for rid in self._in_engine)
            lend = self.remote_prefill is None  # a request whose KV is made elsewhere is not given back
            if lend and (reclaim := self._fair.to_reclaim(running, len(self._in_engine))):
                running[reclaim[0]] -= self._give_back(*reclaim)
            while (picked := self._fair.next(running, len(self._in_engine), lend)) is not None:
                tenant, request_id = picked
                if request_id in self._futures:  # else aborted while it waited
                    self._add(request_id)
                    running[tenant] += request_id in self._in_engine
            return running

    def _give_back(self, tenant: str, count: int) -> int:
        """Take the latest `count` of `tenant`'s requests out of the engine (their work so far is dropped) to
        wait first in its queue again: the reserve it borrowed while alone, for a newcomer. Returns how many."""
        latest = [rid for rid in reversed(self._in_engine) if self._tenant_of.get(rid) == tenant][:count]
        for request_id in latest:
            del self._in_engine[request_id]
            self.engine.abort_request(request_id)
            self._fair.push(tenant, request_id, self._requests[request_id][2], front=True)
        return len(latest)

    def _pause(self, running: Counter | None) -> tuple[bool, int]:
        """Fair share's time slicing: tell the engine whose requests sit out the next step. `running`: each
        tenant's requests in the engine, as `_admit` left them (None while isolating). Returns whether some sit
        out for a smaller tenant's sake, and how many requests step. Each step pays for this: nothing is counted
        or listed that the answer does not need."""
        with self._lock:
            tenants, split = set(), set()
            sharing = running is not None and not self._isolating()
            if sharing:
                tenants = self._fair.to_pause(running)
            ids = [rid for rid in self._in_engine if self._tenant_of.get(rid) in tenants] if tenants else []
            if sharing and self._fair.may_split(running):
                stepping: dict[str, list[str]] = {}
                for rid in self._in_engine:
                    if (tenant := self._tenant_of.get(rid)) not in tenants:
                        stepping.setdefault(tenant, []).append(rid)
                split = self._fair.to_split(stepping)
            count = len(self._in_engine) - len(ids) - len(split)
        if ids or split or self._paused_any:
            self.engine.pause_requests([*ids, *split])
        self._paused_any = bool(ids or split)
        return bool(ids), count

    def _prepare(self, prompt, params):
        """A generation request checked and tokenized (its images loaded) by the engine, in the submitting
        thread rather than the engine loop's; the ValueError of bad input; None for any other request."""
        if not isinstance(params, SamplingParams):
            return None
        try:
            return self.engine.prepare_request(prompt, params)
        except Exception as exc:
            return exc

    def _add(self, request_id: str) -> None:
        """Put a known request into the engine (under the lock); a rejected one fails alone."""
        prompt, params, priority, prepared = self._requests[request_id]
        if self.remote_prefill is not None and self.remote_prefill.start(request_id, prompt, params, self._prefilled):
            self._in_engine[request_id] = None  # it holds a place while its KV is made elsewhere
            return
        self._add_local(request_id, prompt, params, priority, prepared)

    def _prefilled(self, request_id: str, bundle) -> None:
        """A remote prefill ended: import its KV, or (None) prefill it here after all."""
        with self._lock:
            if request_id not in self._in_engine or request_id not in self._requests:
                return  # aborted meanwhile
            prompt, params, priority, prepared = self._requests[request_id]
            try:
                if bundle is not None:
                    self.engine.add_imported_request(request_id, bundle, params)
                    return
            except ValueError as exc:
                log.warning("KV of %s not imported (%s); prefilling it here", request_id, exc)
            finally:
                self._wake.set()
            self._in_engine.pop(request_id, None)
            self._add_local(request_id, prompt, params, priority, prepared)

    def _add_local(self, request_id: str, prompt, params, priority: int = 0, prepared=None) -> None:
        try:
            if isinstance(params, PoolingParams):  # an embedding request: one prompt or a line's list of them
                self.engine.add_pooling_request(request_id, prompt, params)
            elif prepared is not None:
                rank = priority if self._engine_priority else 0
                self.engine.add_prepared_request(request_id, prompt, params, prepared, priority=rank)
            elif priority and self._engine_priority:
                self.engine.add_request(request_id, prompt, params, priority=priority)
            else:
                self.engine.add_request(request_id, prompt, params)
        except Exception as exc:  # handed to the caller through the future
            self._requests.pop(request_id, None)
            self._tenant_of.pop(request_id, None)
            self._futures.pop(request_id).set_exception(exc)
            return
        self._in_engine[request_id] = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._advance_isolation()
            running = self._admit()
            if not self.engine.has_unfinished_requests():
                self._finish_startup_when_idle()
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            self._idle_since = None
            paused, stepping = self._pause(running)
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # isolate the request that failed, keep serving
                if self.observer is not None:
                    self.observer.step_failed(exc)
                if getattr(exc, "fatal", False):  # the engine cannot go on (a tensor-parallel rank died)
                    _end_process(exc)
                self._step_failed(exc)
                continue
            elapsed = time.perf_counter() - started
            self._fair.stepped(elapsed, paused, stepping, self.rates.observe(self.engine, elapsed))
            if self.observer is not None:
                self.observer.step_done(outputs, elapsed)
            for output in outputs:
                if not output.finished and getattr(output, "kv_export", None) is None:
                    continue  # a prefill-only request's output (kv_export set) is final
                with self._lock:
                    future = self._futures.pop(output.request_id, None)
                    self._requests.pop(output.request_id, None)
                    self._tenant_of.pop(output.request_id, None)
                    self._in_engine.pop(output.request_id, None)
                if future is not None:
                    future.set_result(output)

    def _finish_startup_when_idle(self) -> None:
        """A deferred start's compiling (`ModelRunner.finish_startup`), once the engine has had nothing to do
        for STARTUP_IDLE_S: between shards, not in the middle of one. Then what start-up loaded is frozen out
        of the garbage collector's full collections, as the engine was (`engine.runner.gc_heap`): left
        unfrozen, the compiler's modules alone made each full collection walk ~250k objects (0.15 s with the
        interpreter lock held, three times a 10,000-line job on the tiny model)."""
        if self._startup_finished or self._requests:
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= STARTUP_IDLE_S:
            self._startup_finished = True
            if self.engine.finish_startup():
                log.info("kernels compiled in %.1f s of idle time", time.monotonic() - now)
            freeze_what_startup_added()

    def _advance_isolation(self) -> None:
        with self._lock:
            if self._group is not None:
                self._group &= self._in_engine.keys()
                if self._group:
                    return  # the current suspects are still running
                self._group = None
            while self._suspects and self._group is None:
                group = [rid for rid in self._suspects.popleft() if rid in self._futures]
                for request_id in group:
                    self._add(request_id)
                self._group = set(group) & self._in_engine.keys() or None
            if self._group is None and self._held:  # every suspect is cleared: back to normal
                held, self._held = self._held, []
                for request_id in held:
                    if request_id in self._futures:
                        self._add(request_id)

    def _step_failed(self, exc: Exception) -> None:
        with self._lock:
            suspects = sorted(self._in_engine)
            self._in_engine.clear()
            self._group = None
        log.warning(
            "engine step failed with %d requests in flight (%s: %s); isolating the culprit",
            len(suspects),
            type(exc).__name__,
            exc,
        )
        for request_id in suspects:
            with contextlib.suppress(Exception):
                self.engine.abort_request(request_id)
        if len(suspects) == 1:
            with self._lock:
                future = self._futures.pop(suspects[0], None)
                self._requests.pop(suspects[0], None)
                self._tenant_of.pop(suspects[0], None)
            if future is not None:
                log.error("request %s makes the engine fail; failing it alone", suspects[0])
                future.set_exception(exc)
            return
        half = len(suspects) // 2
        with self._lock:
            self._suspects.extendleft([suspects[half:], suspects[:half]])


def _end_process(exc: BaseException) -> None:
    """End the worker at once: its shards' leases run out and other workers take them again, as for a
    worker that died (nothing is written for the requests in flight)."""
    log.critical("the engine cannot go on, ending this worker: %s: %s", type(exc).__name__, exc)
    logging.shutdown()
    os._exit(70)
