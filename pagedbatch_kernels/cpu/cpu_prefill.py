"""The CPU engine's attention for prompt chunks: per sequence and KV head, the scores of a block of
queries against the context up to its last position are one matmul, the causal softmax a compiled
kernel, and the weighted sum of values another matmul.

On an AMD EPYC PyTorch's flash SDPA ran at ~75 GFLOP/s in float32 and bfloat16 alike; the matmuls
below run as linear layers on oneDNN (`linear`), several times faster there. They run in the
cache's dtype where oneDNN has fast kernels for it (`matmul_dtype`: bfloat16 goes to AMX or AVX-512
BF16, as `transformers` computes a bfloat16 model's scores in bfloat16 too), else in float32; the
softmax is always float32. Scores are materialised a block of QUERY_BLOCK tokens at a time, so
memory stays bounded by QUERY_BLOCK x the context.

Which of the two is faster depends on the CPU: PyTorch's flash SDPA (`pagedbatch_kernels.reference`) calls MKL
and oneDNN's brgemm, which on an Intel Xeon with AMX ran 3-4x faster than the matmuls above.
Where the native kernels are built, `cpu_native.span_attention` is a third choice (each sequence a
span of rows over its block table). `prefill_attention` therefore times those usable here once per
process and shape on a synthetic prompt (`calibrate`), and apart for steps of many short prompts, and keeps the
fastest;
PAGEDBATCH_CPU_PREFILL=sdpa, =matmul or =native fixes the choice (sdpa where native cannot run).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from pagedbatch_kernels import reference, startup
from pagedbatch_kernels.compiled import Compiled
from pagedbatch_kernels.cpu import cpu_native
from settings import EngineSettings, value

log = logging.getLogger(__name__)
QUERY_BLOCK = 256
CALIBRATION_TOKENS = 1024
# A step of at least MANY_PROMPTS prompt chunks averaging at most SHORT_MEAN tokens is timed and chosen for apart,
# on prompts of SHORT_PROMPT tokens: there a call per prompt (SDPA's, the matmuls') outweighs the attention.
MANY_PROMPTS = 4
SHORT_MEAN = 128
SHORT_PROMPT = 32
CHOICE_ENV = "PAGEDBATCH_CPU_PREFILL"


EXACT_ROWS = 8  # up to this many rows, every count is a size of its own


def padded_rows(rows: int) -> int:
    """The row count a oneDNN call of `rows` rows runs with: `rows` rounded up to a multiple of an eighth of
    the power of two below it (9..16 exact, then 18, 20, .., 32, 36, ..). oneDNN builds a primitive for every
    shape it meets (0.3-0.7 ms), and row counts change at every step; padded, they share a few dozen."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def onednn_bf16() -> bool:
    """Whether oneDNN has bfloat16 kernels on this CPU (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX): without
    them it refuses to pack or multiply bfloat16."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def linear(x, weight):
    """x @ weight.T on oneDNN where it is there (float32 `matmul` goes to MKL, which on AMD CPUs is
    less than half as fast), else torch's."""
    if x.device.type == "cpu" and torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return torch.nn.functional.linear(x, weight)


def matmul_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype the attention matmuls run in for a cache of `cache_dtype`: bfloat16 where oneDNN has
    kernels for it on this CPU."""
    return torch.bfloat16 if cache_dtype == torch.bfloat16 and onednn_bf16() else torch.float32


def causal_softmax(scores, scale, first_position, group):
    """softmax(scores * scale) of rows [token0 head0, token0 head1, ..., token1 head0, ...] (`group`
    heads per token) over context columns, each token seeing the columns up to its own position
    (`first_position` is the first row's, a 0-d tensor); in float32, returned in the scores' dtype."""
    rows, columns = scores.shape
    positions = first_position + torch.arange(rows, device=scores.device) // group
    hidden = torch.arange(columns, device=scores.device)[None, :] > positions[:, None]
    return torch.softmax((scores.float() * scale).masked_fill(hidden, float("-inf")), dim=-1).to(scores.dtype)


_causal_softmax = Compiled(causal_softmax, varying={0: (0, 1)})


def prefill_attention(query, k_cache, v_cache, block_tables, lengths, starts, scale, out, seqs):
    """Into `out`: the attention of the new tokens of each sequence in `seqs` over its context
    (`lengths` and `starts` as the host-side lists of seq_lens and query_start_loc), through the
    faster of SDPA and the matmuls on this CPU."""
    if seqs:
        tokens = sum(starts[i + 1] - starts[i] for i in seqs)
        kind = "short" if len(seqs) >= MANY_PROMPTS and tokens <= SHORT_MEAN * len(seqs) else "long"
        kernel = _choice(query.dtype, query.shape[1], k_cache.shape[2], query.shape[2], k_cache.shape[1], kind)
        kernel(query, k_cache, v_cache, block_tables, lengths, starts, scale, out, seqs)


def matmul_prefill_attention(query, k_cache, v_cache, block_tables, lengths, starts, scale, out, seqs):
    """`prefill_attention` through oneDNN matmuls and the compiled causal softmax."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    dtype = matmul_dtype(k_cache.dtype)
    for i in seqs:
        length, q_len = lengths[i], starts[i + 1] - starts[i]
        keys = reference._gather_context("k", k_cache, block_tables[i], length)  # [L, kv, D]
        values = reference._gather_context("v", v_cache, block_tables[i], length)
        for h in range(num_kv_heads):
            k = keys[:, h].to(dtype).contiguous()
            v = values[:, h].to(dtype).t().contiguous()  # [D, L]
            heads = slice(h * group, (h + 1) * group)
            for first in range(0, q_len, QUERY_BLOCK):
                last = min(first + QUERY_BLOCK, q_len)
                tokens = slice(starts[i] + first, starts[i] + last)
                context = length - q_len + last  # the block's last token sees this many
                q = query[tokens, heads].reshape(-1, head_dim).to(dtype)
                position = torch.tensor(length - q_len + first, device=query.device)
                weights = _causal_softmax(linear(q, k[:context]), scale, position, group)
                block = linear(weights, v[:, :context].contiguous() if context < length else v)
                out[tokens, heads] = block.view(last - first, group, head_dim).to(out.dtype)


def native_prefill_attention(query, k_cache, v_cache, block_tables, lengths, starts, scale, out, seqs):
    """`prefill_attention` through the native span kernel (`cpu_native`): each sequence's new tokens
    one span over its block table, token j of a chunk of n seeing its context up to itself."""
    row_lens = torch.zeros(query.shape[0], dtype=torch.int32)
    for i in seqs:
        q_len = starts[i + 1] - starts[i]
        row_lens[starts[i] : starts[i + 1]] = torch.arange(lengths[i] - q_len + 1, lengths[i] + 1)
    bounds = torch.tensor([[starts[i], starts[i + 1]] for i in seqs], dtype=torch.int32)
    tables = block_tables[torch.tensor(seqs, device=block_tables.device)]
    result, _ = cpu_native.span_attention(query, k_cache, v_cache, tables, bounds, row_lens.to(query.device), scale)
    for i in seqs:
        out[starts[i] : starts[i + 1]] = result[starts[i] : starts[i + 1]].to(out.dtype)


KERNELS = {"sdpa": reference.prefill_attention, "matmul": matmul_prefill_attention, "native": native_prefill_attention}


def usable(name: str, dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return name != "native" or cpu_native.takes(dtype, num_heads, num_kv_heads, head_dim)


_choices: dict[tuple, str] = {}
_choice_lock = threading.Lock()


def _choice(dtype, num_heads, num_kv_heads, head_dim, block_size, kind="long"):
    fixed = value(EngineSettings, "cpu_prefill")  # one of KERNELS, checked there
    if fixed:
        return KERNELS[fixed if usable(fixed, dtype, num_heads, num_kv_heads, head_dim) else "sdpa"]
    if startup.quick():  # no timing: the span kernel where it is built, else SDPA (neither compiles)
        return KERNELS["native" if usable("native", dtype, num_heads, num_kv_heads, head_dim) else "sdpa"]
    key = (dtype, num_heads, num_kv_heads, head_dim, block_size, kind)
    with _choice_lock:
        if key not in _choices:
            _choices[key] = calibrate(*key)
            log.info("CPU prefill attention for %s: %s", key, _choices[key])
    return KERNELS[_choices[key]]


@torch.no_grad()
def calibrate(
    dtype,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    kind: str = "long",
    tokens: int = CALIBRATION_TOKENS,
    repeats: int = 3,
) -> str:
    """The name of the fastest kernel on `tokens` random tokens (best of `repeats`): one prompt (`kind`
    "long"), or prompts of SHORT_PROMPT tokens ("short": a step of many short requests, where a kernel
    call per prompt costs more than the attention)."""
    prompt = tokens if kind == "long" else SHORT_PROMPT
    count = tokens // prompt
    width = -(-prompt // block_size)
    shape = (count * width, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    query = torch.randn(count * prompt, num_heads, head_dim).to(dtype)
    args = (
        query,
        k_cache,
        v_cache,
        torch.arange(count * width, dtype=torch.int32).view(count, width),
        [prompt] * count,
        list(range(0, count * prompt + 1, prompt)),
        head_dim**-0.5,
        torch.empty_like(query),
        list(range(count)),
    )
    return fastest(
        {
            name: lambda kernel=kernel: kernel(*args)
            for name, kernel in KERNELS.items()
            if usable(name, dtype, num_heads, num_kv_heads, head_dim)
        },
        repeats,
    )


def fastest(runs: dict, repeats: int) -> str:
    """The name of the fastest of `runs` (name -> call), each run once first (compiles, allocates),
    then timed best of `repeats`."""
    best = {}
    for name, run in runs.items():
        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        best[name] = min(times)
    return min(best, key=best.get)
