"""How many intra-op threads a CPU step runs on: all of torch's while the host gives them their cores,
one while it does not.

Every parallel region ends at a barrier that waits for each thread of the team; on a shared host where
another process holds one of the cores, the descheduled thread makes each region wait for the
scheduler (milliseconds), and a step runs hundreds of regions. On the 2-core AMD EPYC at load 5-8 the
MoE bench's run took 25-53 s on two threads and 7-8 s on one. A step on all threads whose process got
less than SHARE of those threads' time (CPU time over wall time: a waiting, descheduled thread
accrues none) puts the next PROBE_STEPS steps on one thread; then all threads are tried again.
`cpu_threads=all` (the default) keeps every thread always: results then do not depend on the host's load
(a GEMM's sums may be split differently on one thread and on two)."""

from __future__ import annotations

import contextlib
import time

import torch

from settings import EngineSettings, value

SHARE = 0.6  # below this share of the threads' time, the host is taken to be busy
PROBE_STEPS = 32  # steps on one thread before all threads are tried again
MIN_WALL = 0.005  # shorter steps are not judged (too few regions to tell)


class StepThreads:
    def __init__(self):
        self.threads = torch.get_num_threads()
        self.single_left = 0  # steps left on one thread

    @contextlib.contextmanager
    def step(self):
        if self.threads == 1 or value(EngineSettings, "cpu_threads") == "all":
            yield
            return
        if self.single_left > 0:
            self.single_left -= 1
            torch.set_num_threads(1)
            try:
                yield
            finally:
                torch.set_num_threads(self.threads)
            return
        wall, cpu = time.perf_counter(), time.process_time()
        yield
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if wall >= MIN_WALL and cpu < SHARE * self.threads * wall:
            self.single_left = PROBE_STEPS
