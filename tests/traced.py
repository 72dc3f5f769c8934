"""Peak Python memory (tracemalloc) of a call, measured in a fresh process.

On Python before 3.12, tracemalloc.stop() races with threads that allocate while waiting for the GIL
(CPython gh-128679, never fixed in 3.11): a thread left running by an earlier test crashed the whole test
process with a segmentation fault. A spawned child runs the call alone, where no such thread lives.
"""

from __future__ import annotations

import multiprocessing
import tracemalloc
from concurrent.futures import ProcessPoolExecutor


def _call_traced(prepare, measure, args):
    state = prepare(*args)  # imports, first-use caches, warm-ups: not traced
    tracemalloc.start()
    try:
        result = measure(state)
        retained, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, retained, peak


def traced_in_child(prepare, measure, *args, timeout: float = 300):
    """In a spawned process: `state = prepare(*args)`, then `measure(state)` under tracemalloc. Returns
    (what measure returned, traced bytes still allocated when it returned, peak traced bytes). The
    functions must be at module level and args and the result must pickle."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_call_traced, prepare, measure, args).result(timeout=timeout)
