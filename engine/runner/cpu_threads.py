"""How many intra-op threads a CPU step runs on: all of torch's while the host gives them their cores,
one while it does not.

Every parallel region ends at a barrier that waits for each thread of the team; on a shared host where
another process holds one of the cores, the descheduled thread makes each region wait for the
scheduler (milliseconds), and a step runs hundreds of regions. On the 2-core AMD EPYC at load 5-8 the
MoE bench's run took 25-53 s on two threads and 7-8 s on one. A step on all threads whose process got
less than SHARE of those threads' time (CPU time over wall time: a waiting, descheduled thread
accrues none) puts the next PROBE_STEPS steps on one thread; then all threads are tried again.
`cpu_threads=all` (the default) keeps every thread for every step big enough to gain from them: results
then do not depend on the host's load (a GEMM's sums may be split differently on one thread and on two).

Either way a small step runs on one thread: one of under SMALL_STEP_MACS multiply-adds (its new tokens
times the language model's weights; a decode step of a small model) is a few milliseconds of arithmetic
on one core, under the cost of its hundreds of parallel regions' fork and join on two. The KV cache a
step's attention reads counts too, KV_READ_MACS to an element: a decode step reads the pool from memory
(it rarely stays in cache from one step to the next), at about a sixteenth of the rate at which a core
multiplies weights it holds in cache, and a second core nearly doubles that rate (256 rows of ~100
positions on the micro model of bench.step_overhead: 1.1 ms on one thread, 0.68 on two). Which steps
those are depends on the step's size alone, never on the host's load."""

from __future__ import annotations

import contextlib
import time

import torch

from settings import EngineSettings, value

SHARE = 0.6  # below this share of the threads' time, the host is taken to be busy
PROBE_STEPS = 32  # steps on one thread before all threads are tried again
MIN_WALL = 0.005  # shorter steps are not judged (too few regions to tell)
SMALL_STEP_MACS = 2**26  # below this many multiply-adds a step runs on one thread
KV_READ_MACS = 16  # a KV cache element read, in multiply-adds of the same time


class StepThreads:
    def __init__(self, macs_per_token: int = 0, kv_per_position: int = 0):
        self.threads = torch.get_num_threads()
        self.macs_per_token = macs_per_token  # the language model's weights (0: no step counts as small)
        self.kv_per_position = kv_per_position  # KV cache elements of one position, every layer's
        self.single_left = 0  # steps left on one thread

    def may_be_small(self, tokens: int) -> bool:
        """Whether a step of `tokens` new tokens is small by its weights alone (its context may still not be)."""
        return 0 < tokens * self.macs_per_token < SMALL_STEP_MACS

    def small(self, tokens: int, context: int) -> bool:
        """Whether a step of `tokens` new tokens whose rows attend to `context` positions in all is small."""
        macs = tokens * self.macs_per_token + context * self.kv_per_position * KV_READ_MACS
        return self.may_be_small(tokens) and macs < SMALL_STEP_MACS

    @contextlib.contextmanager
    def step(self, tokens: int = 0, context: int = 0):
        if self.threads == 1:
            yield
            return
        if self.small(tokens, context):
            with one_thread():
                yield
            return
        if value(EngineSettings, "cpu_threads") == "all":
            yield
            return
        if self.single_left > 0:
            self.single_left -= 1
            with one_thread():
                yield
            return
        wall, cpu = time.perf_counter(), time.process_time()
        yield
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if wall >= MIN_WALL and cpu < SHARE * self.threads * wall:
            self.single_left = PROBE_STEPS


@contextlib.contextmanager
def one_thread(when: bool = True):
    """Torch's intra-op threads down to one for the block, where `when`; back to as many after."""
    before = torch.get_num_threads()
    if not when or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
