"""The engine's objects kept out of full collections: frozen for good in a worker, for a run elsewhere."""

import gc
import subprocess
import sys
import weakref

from engine.runner.gc_heap import frozen_heap


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def test_frozen_heap_hides_existing_objects_then_lets_them_be_collected():
    assert gc.get_freeze_count() == 0
    node = Node()
    alive = weakref.ref(node)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None  # frozen: a full collection does not even look at it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None  # back in the oldest generation, and garbage


def test_frozen_heap_leaves_a_freeze_made_by_someone_else_alone():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            Node()
        assert gc.get_freeze_count() == frozen  # neither thawed nor frozen further
    finally:
        gc.unfreeze()


def test_a_worker_freezes_what_its_loaded_engine_holds_for_good():
    code = (
        "import gc\n"
        "from engine.runner.gc_heap import freeze_loaded_heap\n"
        "garbage = [[]]; garbage[0].append(garbage); del garbage\n"
        "kept = freeze_loaded_heap()\n"
        "assert kept == gc.get_freeze_count() > 1000, kept\n"
        "assert gc.collect() == 0  # collected before the freeze, nothing of it left\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
