"""The CPU KV pool's pages mapped ahead of the blocks handed out, in the background.

The pool comes from `calloc` (engine.runner.device.zeros): it costs nothing until used, and each page
is mapped at its first write, a page fault inside a step's KV write (~3,500 a run of bench.moe on the
AMD EPYC here). The block manager hands never-used blocks out in ascending order, so the pages a step
will first write are those just past the highest block handed out so far. A thread keeps the pages of
the next `ahead` blocks mapped (`MADV_POPULATE_WRITE`: the kernel maps them as a write fault would,
without touching their contents, so it may run beside the steps that write the pool; the thread runs
only while there is something to map), so that a step never waits for a fault, and memory grows only
`ahead` blocks past what the engine has used. Where the kernel lacks it (before Linux 5.14) nothing
is done.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
PAGE = 4096
PREFAULT_BYTES = 256 << 20  # the most of the pool mapped ahead of use
CHUNK_BYTES = 8 << 20  # mapped per call, per pool tensor: the thread catches up in steps this size


class KVPrefault:
    def __init__(self, pools: list[torch.Tensor], num_blocks: int, ahead: int):
        self.pools = pools  # every layer's K and V pool: [num_blocks, ...] each, page-aligned
        self.num_blocks = num_blocks
        self.ahead = ahead
        self.mapped = 0  # blocks [0, mapped) of every pool are mapped
        self._target = 0
        self._wake = threading.Condition()
        self._madvise = _madvise()
        self._running = False  # a thread is mapping

    def ensure(self, used: int) -> None:
        """Blocks [0, used) have been handed out: keep the next `ahead` mapped, topped up each time half of
        them are taken (a thread, started then, maps them and ends: it holds the GIL rarely, and nothing
        keeps the pool alive once the engine is gone)."""
        if used + self.ahead // 2 < self._target or self._target == self.num_blocks or self._madvise is None:
            return
        with self._wake:
            self._target = min(self.num_blocks, used + self.ahead)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="pagedbatch-kv-prefault", daemon=True).start()

    def wait(self, timeout: float = 10.0) -> bool:
        """Until the pages up to the last target are mapped (tests); False on timeout."""
        with self._wake:
            return self._wake.wait_for(lambda: self.mapped >= self._target or self._madvise is None, timeout)

    def _run(self) -> None:
        per_block = [pool[0].numel() * pool.element_size() for pool in self.pools]
        step = max(1, CHUNK_BYTES // max(per_block))
        while True:
            with self._wake:
                if self.mapped >= self._target or self._madvise is None:
                    self._running = False
                    self._wake.notify_all()
                    return
                first = self.mapped
                last = min(self._target, first + step)
            for pool, size in zip(self.pools, per_block):
                if not self._map(pool.data_ptr() + first * size, (last - first) * size):
                    break
            else:
                with self._wake:
                    self.mapped = last
                    self._wake.notify_all()

    def _map(self, address: int, length: int) -> bool:
        begin = address - address % PAGE  # the page holding the range's first byte may be mapped already
        if self._madvise(ctypes.c_void_p(begin), ctypes.c_size_t(address + length - begin), MADV_POPULATE_WRITE) == 0:
            return True
        why = ctypes.get_errno()
        log.info("KV pool pages are mapped at first use: madvise(MADV_POPULATE_WRITE) failed (errno %d)", why)
        self._madvise = None
        return False


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
