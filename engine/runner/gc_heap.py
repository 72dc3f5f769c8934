"""The engine's objects out of the garbage collector's sight while a process serves.

Python's oldest generation is collected whenever enough young objects survive, and a full collection walks
every tracked object: with a model, its tokenizer, torch and transformers loaded, a few hundred thousand of
them, 0.1-0.2 s each with the GIL held while nothing else runs. A worker that turns ten thousand lines into
requests and rows triggers one every second or two (0.7 s of a 6 s job in bench.platform on a 2-core Xeon;
0.2-0.4 s of `pagedbatch run`'s 4 s). Frozen objects are not walked, and not collected either:
`freeze_loaded_heap` is for a process that keeps its engine to the end (a worker, as vLLM's engine core
does after start-up), `frozen_heap` for a run inside a longer-lived process, which collects again after.
"""

from __future__ import annotations

import contextlib
import gc


def freeze_loaded_heap() -> int:
    """Collect what is garbage now, then move every surviving object to the permanent generation, for good;
    returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def freeze_what_startup_added() -> bool:
    """In a process that froze its loaded heap (`freeze_loaded_heap`), freeze what start-up added since: a
    worker's deferred kernel compile (the compiler's modules, a few hundred thousand objects), Celery's start,
    the modules its first shards imported. Call it when no request is in flight, so that what it freezes
    lives as long as the process; returns whether it froze anything."""
    if not gc.get_freeze_count():
        return False
    freeze_loaded_heap()
    return True


@contextlib.contextmanager
def frozen_heap():
    """Every object that exists on entry frozen for the block, collectible again after it. Where something
    else froze objects already (this process's owner), it is left to manage them: nothing changes."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
