"""Thread priorities in the worker: the engine first, the worker's own bookkeeping after it.

On Linux, nice values belong to threads, and a new thread starts with its creator's. The worker
loads its engine (the loop thread and, on CPU, its OpenMP threads) first, then lowers the main
thread's priority, so every thread started afterwards (Celery's pool running the shard tasks, the
cancel watcher, the sweeper, the lease keeper) yields to the engine. On CPU this matters: the engine's
OpenMP threads wait for each other at every parallel region, so a bookkeeping thread that takes a
core from one of them stalls them all.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

BOOKKEEPING_NICE = 10


def lower_this_thread(nice: int = BOOKKEEPING_NICE) -> int:
    """Add `nice` to the calling thread's nice value (not the process's); returns the new value.

    Raising one's own nice value needs no privilege. Where threads cannot be told apart (not Linux),
    nothing changes.
    """
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(current + nice, 19))
        return os.getpriority(os.PRIO_PROCESS, tid)
    except (AttributeError, OSError) as exc:
        log.warning("could not lower the priority of the worker's bookkeeping threads: %s", exc)
        return 0
