"""Attention sinks (gpt-oss: a learned logit per head in each softmax's denominator) in the torch
reference and the CPU engine's set (which routes sink layers to the reference), against a naive float64
twin: decodes, fresh prefills and chunks after a cached prefix, with and without a sliding window."""

from __future__ import annotations

import pytest
import torch

from pagedbatch_kernels import reference
from pagedbatch_kernels.cpu import cpu_attention
from tests.kernels.test_reference import make_batch
from tests.kernels.test_window import CTX, Q_LENS, _err
from tests.kernels.test_window import naive as window_naive


def naive(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sinks, window=None):
    return window_naive(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window, sinks=sinks)


@pytest.mark.parametrize("window", [None, 8, 21])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
def test_reference_and_cpu_set_with_sinks(window, heads):
    batch = make_batch(Q_LENS, CTX, *heads, torch.float32)
    sinks = torch.randn(heads[0]) * 3  # large enough to take a real share of the softmax
    expected = naive(**batch, sinks=sinks, window=window)
    plain = naive(**batch, sinks=torch.full((heads[0],), -1e9), window=window)
    assert _err(plain, expected) > 1e-2  # the sinks matter here
    for fn in (reference.paged_attention, cpu_attention.paged_attention):
        got = fn(**batch, window=window, sinks=sinks)
        assert _err(got, expected) < 1e-5, fn.__module__


def test_sinks_in_decodes_sharing_prefix_blocks():
    """Sibling decodes read their shared blocks once; each head keeps its own sink."""
    batch = make_batch([1, 1, 1], [40, 44, 47], 4, 2, torch.float32)
    batch["block_tables"][1] = batch["block_tables"][0]
    batch["block_tables"][2] = batch["block_tables"][0]
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0])
    expected = naive(**batch, sinks=sinks)
    assert _err(reference.paged_attention(**batch, sinks=sinks), expected) < 1e-5
