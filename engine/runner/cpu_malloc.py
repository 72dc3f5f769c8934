"""Keep freed memory in the process on the CPU engine, so that a step's large buffers are not
page-faulted in afresh at every step.

glibc serves every allocation over 32 MiB (a prompt chunk's MLP activations: 8,192 tokens x 2,048
floats is 64 MiB) with a fresh `mmap` and returns it to the kernel when freed; the next step
faults every page in again and the kernel zeroes it. On this project's VMs that cost a long prompt
step a third of its time. `keep_freed_memory` tells glibc to serve them from its heap and to keep
the heap's top when freed (`mallopt`), as vLLM's CPU build gets from tcmalloc. The resident size
then stays at the largest step's peak instead of falling back between steps.

PAGEDBATCH_CPU_MALLOC=default leaves glibc as it is; other C libraries are left alone anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import resource
import threading

from settings import EngineSettings, value

log = logging.getLogger(__name__)
ENV = "PAGEDBATCH_CPU_MALLOC"
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
_done = threading.Event()


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc, else None."""
    name = ctypes.util.find_library("c")
    if name is None or not hasattr(os, "confstr"):
        return None
    try:
        if "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") or "").lower():
            return None
        return ctypes.CDLL(name)
    except (OSError, ValueError):
        return None


def keep_freed_memory() -> bool:
    """Once per process; True where glibc took the settings."""
    if _done.is_set():
        return True
    if value(EngineSettings, "cpu_malloc") == "default":
        return False
    libc = _glibc()
    if libc is None:
        return False
    try:
        taken = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(0x7FFFFFFF)) == 1
    except (OSError, ValueError, AttributeError):
        return False
    if taken:
        _done.set()
        log.debug("glibc malloc: no mmap for large blocks, no trimming")
    return taken


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_bytes() -> int:
    """Bytes glibc holds from the kernel (every arena's heap and mmapped blocks; glibc 2.33+), else the
    peak resident size. Not the current resident size: pages are counted once mapped, touched or not."""
    libc = _glibc()
    mallinfo2 = getattr(libc, "mallinfo2", None) if libc is not None else None
    if mallinfo2 is not None:
        mallinfo2.restype = _MallInfo2
        info = mallinfo2()
        return info.arena + info.hblkhd
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def prefault(nbytes: int) -> None:
    """Map `nbytes` more of the heap now (allocated, written, freed): kept by `keep_freed_memory`, the
    pages serve later allocations without faulting."""
    if _done.is_set() and nbytes > 0:
        import torch  # only the CPU engine calls this

        torch.empty(nbytes, dtype=torch.uint8).fill_(0)
