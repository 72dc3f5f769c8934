"""The CPU KV pool's pages mapped ahead of use (engine/runner/kv_prefault.py): the next blocks' pages
become resident, later ones stay unmapped, and what a step already wrote is never changed."""

from __future__ import annotations

import ctypes
import gc
import mmap
import time
import weakref

import torch

from engine import LLM, SamplingParams
from engine.runner.kv_prefault import PAGE, KVPrefault

BLOCK_BYTES = 8 * PAGE  # two pools of 64 blocks, each block eight pages


def resident(tensor: torch.Tensor, first_byte: int, length: int) -> list[bool]:
    """Whether each page of the range is mapped (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-length // PAGE)
    vector = (ctypes.c_ubyte * pages)()
    start = tensor.data_ptr() + first_byte
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vector]


def fresh_pool(blocks: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A page-aligned pool of never-touched pages (an anonymous mapping of its own)."""
    area = mmap.mmap(-1, blocks * BLOCK_BYTES)
    return area, torch.frombuffer(area, dtype=torch.float32).view(blocks, BLOCK_BYTES // 4)


def test_maps_the_next_blocks_only_and_keeps_their_contents():
    keep = [fresh_pool(64), fresh_pool(64)]
    pools = [pool for _, pool in keep]
    pools[0][0, :5] = torch.arange(5.0)  # a step wrote block 0
    pools[1][3, -1] = 7.0  # and a page inside what is mapped next
    prefault = KVPrefault(pools, num_blocks=64, ahead=10)
    assert not any(resident(pools[0], 10 * BLOCK_BYTES, 20 * BLOCK_BYTES))
    prefault.ensure(2)
    assert prefault.wait()
    for pool in pools:
        assert all(resident(pool, 0, 12 * BLOCK_BYTES))
        assert not any(resident(pool, 12 * BLOCK_BYTES, 52 * BLOCK_BYTES))
    assert pools[0][0, :5].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert pools[1][3, -1].item() == 7.0
    assert float(pools[0][5:12].abs().sum()) == 0.0
    prefault.ensure(60)  # never past the pool's end
    assert prefault.wait()
    assert prefault.mapped == 64
    assert all(resident(pools[1], 0, 64 * BLOCK_BYTES))


def test_the_engine_keeps_its_pool_mapped_ahead_of_the_blocks_it_hands_out(tiny_model):
    llm = LLM(str(tiny_model("llama")), num_kv_blocks=4096, max_num_batched_tokens=256, max_num_seqs=8)
    engine = llm.llm_engine
    prefault = engine.runner.kv_prefault
    assert prefault.ahead == 2 * (256 // 16 + 8)
    prompts = [{"prompt_token_ids": [5 + i] * (40 + 30 * i)} for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    used = engine.block_manager.num_used
    assert used > prefault.ahead  # the run went past the first window
    assert prefault.wait()
    assert used + prefault.ahead // 2 <= prefault.mapped <= min(4096, used + prefault.ahead)
    # (past it the pool may be resident or not: glibc may serve the pool from heap pages used before)
    for pool in (engine.runner.kv_caches[0][0], engine.runner.kv_caches[-1][1]):
        per_block = pool[0].numel() * pool.element_size()
        assert all(resident(pool, 0, prefault.mapped * per_block))


def test_a_small_pool_is_mapped_whole_at_start(tiny_model):
    llm = LLM(str(tiny_model("llama")), num_kv_blocks=64)
    prefault = llm.llm_engine.runner.kv_prefault
    assert prefault.wait()
    assert prefault.mapped == 64


def test_nothing_keeps_the_prefault_or_its_pool_once_mapped():
    """The thread ends when it has mapped what was asked: an engine that is gone leaves no pool behind."""
    area, pool = fresh_pool(16)
    prefault = KVPrefault([pool], num_blocks=16, ahead=8)
    prefault.ensure(0)
    assert prefault.wait()
    ref = weakref.ref(prefault)
    del prefault
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert ref() is None
