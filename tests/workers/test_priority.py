"""The worker's bookkeeping threads run at a lower priority than its engine's."""

from __future__ import annotations

import os
import re
import threading

from workers.priority import lower_this_thread


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_lowering_is_per_thread_and_inherited_by_new_threads():
    base = _nice(threading.get_native_id())
    seen: dict[str, int] = {}
    ready, done = threading.Event(), threading.Event()

    def earlier():
        seen["earlier_tid"] = threading.get_native_id()
        ready.set()
        done.wait(10)

    def lowered():
        seen["lowered"] = lower_this_thread(3)
        child = threading.Thread(target=lambda: seen.__setitem__("child", _nice(threading.get_native_id())))
        child.start()
        child.join()
        seen["earlier"] = _nice(seen["earlier_tid"])

    first = threading.Thread(target=earlier)
    first.start()
    ready.wait(10)
    second = threading.Thread(target=lowered)
    second.start()
    second.join()
    done.set()
    first.join()
    assert seen["lowered"] == min(base + 3, 19)
    assert seen["child"] == seen["lowered"]  # started after: inherits
    assert seen["earlier"] == base  # another thread: unchanged
    assert _nice(threading.get_native_id()) == base  # the caller's caller: unchanged


def test_live_worker_engine_thread_outranks_its_bookkeeping(worker):
    pid = worker._worker.pid
    match = re.search(r"engine loop thread (\d+)", worker.worker_log())
    assert match, worker.worker_log()[-2000:]
    engine_tid = int(match.group(1))
    threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    assert engine_tid in threads
    nice = {tid: _nice(tid) for tid in threads}
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    assert nice[engine_tid] == base
    assert nice[pid] == min(base + 10, 19)  # the main thread: Celery's consumer
    lowered = [tid for tid in threads if nice[tid] > base]
    assert len(lowered) >= 3, nice  # main, Celery's pool, the watchers
