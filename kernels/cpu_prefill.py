"""The CPU engine's attention for prompt chunks: per sequence and KV head, the scores of a block of
queries against the context up to its last position are one matmul, the causal softmax a compiled
kernel, and the weighted sum of values another matmul.

PyTorch's flash SDPA on the CPU ran at ~75 GFLOP/s here in float32 and bfloat16 alike; the matmuls
below run as linear layers on oneDNN (`linear`), several times faster, in float32 whatever the
cache's dtype (as the decode kernels: scores and softmax in float32). Scores are materialised a
block of QUERY_BLOCK tokens at a time, so memory stays bounded by QUERY_BLOCK x the context.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.compiled import Compiled

QUERY_BLOCK = 256


def linear(x, weight):
    """x @ weight.T on oneDNN where it is there (float32 `matmul` goes to MKL, which on AMD CPUs is
    less than half as fast), else torch's."""
    if x.device.type == "cpu" and torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return torch.nn.functional.linear(x, weight)


def causal_softmax(scores, scale, first_position, group):
    """softmax(scores * scale) of rows [token0 head0, token0 head1, ..., token1 head0, ...] (`group`
    heads per token) over context columns, each token seeing the columns up to its own position
    (`first_position` is the first row's, a 0-d tensor)."""
    rows, columns = scores.shape
    positions = first_position + torch.arange(rows, device=scores.device) // group
    hidden = torch.arange(columns, device=scores.device)[None, :] > positions[:, None]
    return torch.softmax((scores * scale).masked_fill(hidden, float("-inf")), dim=-1)


_causal_softmax = Compiled(causal_softmax)


def prefill_attention(query, k_cache, v_cache, block_tables, lengths, starts, scale, out, seqs):
    """Into `out`: the attention of the new tokens of each sequence in `seqs` over its context
    (`lengths` and `starts` as the host-side lists of seq_lens and query_start_loc)."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    for i in seqs:
        length, q_len = lengths[i], starts[i + 1] - starts[i]
        keys = reference._gather_context("k", k_cache, block_tables[i], length)  # [L, kv, D]
        values = reference._gather_context("v", v_cache, block_tables[i], length)
        for h in range(num_kv_heads):
            k = keys[:, h].float().contiguous()
            v = values[:, h].float().t().contiguous()  # [D, L]
            heads = slice(h * group, (h + 1) * group)
            for first in range(0, q_len, QUERY_BLOCK):
                last = min(first + QUERY_BLOCK, q_len)
                tokens = slice(starts[i] + first, starts[i] + last)
                context = length - q_len + last  # the block's last token sees this many
                q = query[tokens, heads].reshape(-1, head_dim).float()
                position = torch.tensor(length - q_len + first, device=query.device)
                weights = _causal_softmax(linear(q, k[:context]), scale, position, group)
                block = linear(weights, v[:, :context].contiguous() if context < length else v)
                out[tokens, heads] = block.view(last - first, group, head_dim).to(out.dtype)
