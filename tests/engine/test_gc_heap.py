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
    before = Node()
    frozen_before = weakref.ref(before)
    gc.freeze()
    try:
        del before
        with frozen_heap():
            inside = Node()
            made_inside = weakref.ref(inside)
            del inside
        gc.collect()
        assert frozen_before() is not None  # still frozen: the block thawed nothing of the owner's
        assert made_inside() is None  # and froze nothing more
    finally:
        gc.unfreeze()
    gc.collect()
    assert frozen_before() is None


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
