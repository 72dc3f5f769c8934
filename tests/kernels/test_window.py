"""Sliding-window and soft-capped paged attention (Mistral, Gemma 2/3) in every kernel set against a
naive float64 twin: the torch reference, the CPU engine's set (which routes such layers to the
reference) and the Triton kernels (through the interpreter on CPU), on decodes, fresh prefills and
chunks after a cached prefix, with windows shorter and longer than a block."""

from __future__ import annotations

import pytest
import torch

from pagedbatch_kernels import reference
from pagedbatch_kernels.cpu import cpu_attention
from tests.kernels.test_reference import make_batch


def naive(
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window=None, softcap=None, sinks=None
):
    """Attention in float64, one query row at a time: the twin every kernel set is checked against."""
    block_size, group = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for i, length in enumerate(seq_lens.tolist()):
        slots = [block_tables[i, p // block_size].item() * block_size + p % block_size for p in range(length)]
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            pos = length - q_len + j
            lo = max(0, pos - window + 1) if window else 0
            s = torch.einsum("hd,lhd->hl", query[starts[i] + j].double(), k[lo : pos + 1]) * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None]], dim=-1)  # the sink: a score without a value
            p = torch.softmax(s, dim=-1)[:, : pos + 1 - lo]
            out[starts[i] + j] = torch.einsum("hl,lhd->hd", p, v[lo : pos + 1])
    return out


# decodes (some sharing nothing, all past the window), a fresh prefill longer than the window,
# chunks after a cached prefix at and off block boundaries
Q_LENS = [1, 1, 1, 40, 9, 1, 23, 3]
CTX = [70, 15, 33, 0, 48, 16, 17, 5]
CASES = [(8, None), (16, None), (21, None), (5, 30.0), (None, 50.0), (1, None), (200, None)]


def _err(got, expected):
    return ((got.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("window,softcap", CASES)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
def test_reference_and_cpu_set_window_softcap(window, softcap, heads):
    batch = make_batch(Q_LENS, CTX, *heads, torch.float32)
    expected = naive(**batch, window=window, softcap=softcap)
    for fn in (reference.paged_attention, cpu_attention.paged_attention):
        got = fn(**batch, window=window, softcap=softcap)
        assert _err(got, expected) < 1e-5, fn.__module__


def test_decodes_sharing_prefix_blocks_keep_their_own_windows():
    """Sibling decodes whose windows start in the same block read it once yet mask their own starts."""
    batch = make_batch([1, 1, 1], [40, 44, 47], 4, 2, torch.float32)
    batch["block_tables"][1] = batch["block_tables"][0]
    batch["block_tables"][2] = batch["block_tables"][0]
    expected = naive(**batch, window=20)
    assert _err(reference.paged_attention(**batch, window=20), expected) < 1e-5


def test_windowed_decode_reads_only_blocks_in_reach():
    """Blocks before the window are not read: poisoning them with NaN changes nothing."""
    batch = make_batch([1, 30], [100, 70], 4, 2, torch.float32)
    expected = naive(**batch, window=16)
    for i, (length, q_len) in enumerate([(101, 1), (100, 30)]):
        first = reference.first_window_block(length, q_len, 16, 16)
        assert first > 0
        for b in batch["block_tables"][i, :first].tolist():
            batch["k_cache"][b] = float("nan")
            batch["v_cache"][b] = float("nan")
    got = reference.paged_attention(**batch, window=16)
    assert _err(got, expected) < 1e-5


@pytest.mark.parametrize("window,softcap", CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_window_softcap_matches_reference(window, softcap, splits):
    triton_ops = pytest.importorskip("pagedbatch_kernels.triton_ops")
    batch = make_batch(Q_LENS, CTX, 6, 2, torch.float32)
    expected = reference.paged_attention(**batch, window=window, softcap=softcap)
    got = triton_ops.paged_attention(**batch, window=window, softcap=softcap, num_splits=splits)
    err = ((got - expected).abs().max() / expected.abs().max()).item()
    assert err < 1e-4
    decodes = make_batch([1, 1, 1], [70, 15, 33], 6, 2, torch.float32)
    expected = reference.paged_attention(**decodes, window=window, softcap=softcap)
    got = triton_ops.paged_attention(**decodes, window=window, softcap=softcap, num_splits=splits, max_query_len=1)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-4
