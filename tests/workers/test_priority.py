"""The worker's bookkeeping threads run at a lower priority than its engine's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from workers.priority import WORKER_OPENMP_SPINS, lower_this_thread, shorten_openmp_spins


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


def test_openmp_spins_shortened_unless_the_environment_chose(monkeypatch):
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):  # set, then deleted: monkeypatch restores what was there
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert shorten_openmp_spins() is True
    assert os.environ["GOMP_SPINCOUNT"] == str(WORKER_OPENMP_SPINS)

    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    assert shorten_openmp_spins() is False
    assert os.environ["GOMP_SPINCOUNT"] == "123"

    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert shorten_openmp_spins() is False
    assert "GOMP_SPINCOUNT" not in os.environ


# After a parallel region, the process sleeps in Python; the CPU time its idle OpenMP thread burns meanwhile.
_IDLE_SPIN_PROBE = """
import time, torch
torch.set_num_threads(2)
a = torch.randn(256, 256)
burnt = []
for _ in range(20):
    a @ a  # a parallel region on both threads
    start = time.process_time()
    time.sleep(0.02)
    burnt.append(time.process_time() - start)
print(sorted(burnt)[len(burnt) // 2])
"""


def _idle_cpu_after_a_region(env: dict) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _IDLE_SPIN_PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return float(out.stdout.strip())


def test_shortened_spins_leave_idle_cores_free():
    """libgomp's default spin (300,000 iterations) keeps an idle OpenMP thread busy for milliseconds after each
    parallel region; the worker's setting lets it sleep within a fraction of one."""
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    base["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    default = _idle_cpu_after_a_region({**base, "GOMP_SPINCOUNT": "300000"})
    short = _idle_cpu_after_a_region({**base, "GOMP_SPINCOUNT": str(WORKER_OPENMP_SPINS)})
    assert short < 0.002, short  # under 2 ms of a 20 ms sleep
    assert default > 2 * short, (default, short)


def test_live_worker_shortens_its_openmp_spins(worker):
    chose = "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ
    line = f"OpenMP threads spin {WORKER_OPENMP_SPINS} iterations, then sleep"
    assert (line in worker.worker_log()) is not chose, worker.worker_log()[-2000:]
