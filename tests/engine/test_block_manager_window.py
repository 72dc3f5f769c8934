"""Blocks released behind a sliding window where every layer of the model is windowed (Mistral v0.1's
config): the block manager on its own (reference counts with forks, prefix caching, release), and the
engine exact against transformers on prompts many windows long in a pool far smaller than one
sequence's whole context (chunked prefill, preemption and prefix caching in such a pool:
tests/engine/test_window_kernels.py); a model with a full-attention layer (Gemma 3) releases nothing."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.core.block_manager import BlockManager
from tests.engine.test_block_manager import BS, admit, make_seq
from tests.engine.test_families import generate, reference
from tests.helpers import assert_pool_free, assert_same, make_prompts


def held(seq) -> list[int]:
    return seq.block_table[seq.num_dropped_blocks :]


def assert_counts(bm: BlockManager, seqs) -> None:
    holders = [0] * bm.num_blocks
    for s in seqs:
        for b in held(s):
            holders[b] += 1
    assert holders == bm.ref_counts
    assert set(bm.free) == {b for b in range(bm.num_blocks) if holders[b] == 0}


@pytest.mark.parametrize("caching", [True, False])
def test_blocks_wholly_behind_the_window_are_released(caching):
    bm = BlockManager(16, BS, enable_prefix_caching=caching, window=6)
    seq = make_seq(range(23))  # positions 0..22; the next token (23) sees 18..23: blocks 0-3 are behind
    admit(bm, seq)
    bm.drop_behind_window(seq)
    assert seq.num_dropped_blocks == 4 and len(held(seq)) == 2
    assert bm.num_free_blocks == 14
    assert_counts(bm, [seq])
    bm.drop_behind_window(seq)  # again: nothing more
    assert bm.num_free_blocks == 14
    bm.release(seq)
    assert bm.num_free_blocks == 16 and seq.num_dropped_blocks == 0
    assert_counts(bm, [])


def test_released_blocks_stay_in_the_prefix_cache_until_reused():
    bm = BlockManager(16, BS, window=6)
    first = make_seq(range(23))
    admit(bm, first)
    bm.drop_behind_window(first)
    again = make_seq(range(23))
    assert admit(bm, again) == first.block_table[:5]  # the released blocks are hits, revived
    assert_counts(bm, [first, again])


def test_forks_share_only_the_blocks_still_held():
    bm = BlockManager(16, BS, window=5)
    parent = make_seq(range(22))
    admit(bm, parent)
    bm.drop_behind_window(parent)
    child = parent.fork(99)
    bm.fork(parent, child)
    assert child.num_dropped_blocks == parent.num_dropped_blocks == 4
    assert_counts(bm, [parent, child])
    bm.release(parent)
    bm.release(child)
    assert bm.num_free_blocks == 16


def test_without_a_window_nothing_is_released():
    bm = BlockManager(16, BS)
    seq = make_seq(range(23))
    admit(bm, seq)
    bm.drop_behind_window(seq)
    assert seq.num_dropped_blocks == 0 and bm.num_free_blocks == 10


def test_long_windowed_sequences_run_in_a_pool_shorter_than_them(tiny_model):
    """Mistral (window 24, every layer): 300-token prompts and their continuations, 16-token blocks,
    in a pool of 12 blocks (192 tokens), one sequence at a time: no preemption, exact."""
    path = tiny_model("mistral", head_dim=32)
    prompts, max_tokens = [p for p in make_prompts(seed=1)[0] if len(p) >= 200][:3], [40, 40, 40]
    llm = LLM(str(path), max_num_batched_tokens=32, num_kv_blocks=12, max_num_seqs=1)
    assert llm.llm_engine.block_manager.window == 24
    ours = generate(llm, prompts, max_tokens)
    assert llm.llm_engine.stats["preemptions"] == 0
    assert_pool_free(llm.llm_engine)
    assert_same([o.outputs[0].token_ids for o in ours], reference(path, "mistral", prompts, max_tokens))


def test_a_full_attention_layer_keeps_every_block(tiny_model):
    llm = LLM(str(tiny_model("gemma3", head_dim=32)), num_kv_blocks=40)
    assert llm.llm_engine.block_manager.window is None
