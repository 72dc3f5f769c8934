"""engine.runner.cpu_malloc: freed large blocks stay in the process, so they are not faulted in again."""

import os
import subprocess
import sys

import pytest

GLIBC = "glibc" in (os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else "").lower()
CYCLES, PAGES = 20, 16_384  # a 64 MiB block is 16,384 pages

# Allocates, fills and frees a 64 MiB block CYCLES times; prints the page faults that took.
FAULTS = f"""
import resource, torch
from engine.runner.cpu_malloc import keep_freed_memory
taken = keep_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({CYCLES}):
    block = torch.ones({PAGES * 1024})
    del block
print(taken, keep_freed_memory(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(**env) -> tuple[str, str, int]:
    out = subprocess.run(
        [sys.executable, "-c", FAULTS], env={**os.environ, **env}, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], out[1], int(out[2])


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's")
def test_freed_large_blocks_are_reused_without_new_page_faults():
    taken, again, faults = _run()
    assert (taken, again) == ("True", "True")
    # the heap grows for the first few blocks (where small allocations land between them), then
    # serves every block from memory it already has
    assert faults < CYCLES * PAGES / 2


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's")
def test_the_default_allocator_can_be_kept_and_then_faults_every_block_in():
    taken, again, faults = _run(PAGEDBATCH_CPU_MALLOC="default")
    assert (taken, again) == ("False", "False")
    assert faults >= CYCLES * PAGES * 0.95


@pytest.mark.parametrize("shape", [(3, 16, 2, 64), (1, 5, 1, 7), (0, 16, 1, 64)])
def test_a_zeroed_pool_is_page_aligned_and_zero(shape):
    """`device.zeros` (the KV pools): zeros of the asked shape starting on a page, so no KV row straddles
    a cache line it need not."""
    import torch

    from engine.runner.device import PAGE, zeros

    pool = zeros(shape, torch.float32, torch.device("cpu"))
    assert pool.shape == shape and pool.is_contiguous() and pool.dtype == torch.float32
    assert pool.data_ptr() % PAGE == 0 or pool.numel() == 0
    assert not pool.any()
