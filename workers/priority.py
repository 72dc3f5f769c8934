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

from settings import export, is_set

log = logging.getLogger(__name__)

BOOKKEEPING_NICE = 10
# How long an idle OpenMP thread spins before it sleeps, in libgomp's busy-wait iterations: its default,
# 300,000, is milliseconds; this is a fraction of one, longer than the gaps between a step's parallel regions.
WORKER_OPENMP_SPINS = 20_000


def shorten_openmp_spins(spins: int = WORKER_OPENMP_SPINS) -> bool:
    """Before torch loads (libgomp reads it once): OpenMP threads spin `spins` iterations, not libgomp's
    default, before they sleep. A worker shares its cores with its shard threads, the API and the database;
    an engine thread waiting for the interpreter lock left its OpenMP threads spinning for milliseconds on
    cores those needed (a third of the worker's CPU time on the tiny model, bench.platform). A value the
    environment gives (GOMP_SPINCOUNT, or OMP_WAIT_POLICY) is left alone. Returns whether it set one."""
    if is_set("GOMP_SPINCOUNT") or is_set("OMP_WAIT_POLICY"):
        return False
    export("GOMP_SPINCOUNT", str(spins))
    return True


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
