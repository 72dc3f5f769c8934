"""Attention of decodes over the prefix blocks that their group shares (a system prompt, sibling
samples), and its log-sum-exp, to merge with each row's attention over its own tail.

A group's queries against its prefix are a small problem: a few dozen rows per KV head. PyTorch's
CPU flash attention ran at ~130 GFLOP/s on it in bfloat16 (AMD EPYC, 8 groups of 32 decodes x 3
heads of 64 over 512 tokens), where one batched matmul over every group and KV head of the step, a
compiled masked softmax and a second batched matmul ran it ~2.3x faster (`bench/cpu_prefix.py`):
oneDNN's bfloat16 kernels only pay off on many matrices at once. The scores are then bfloat16, as
`transformers` computes a bfloat16 model's scores; the softmax and log-sum-exp are float32. (Greedy
bfloat16 outputs agreed with the float32 model's as often either way.) Float32 goes to MKL's
batched matmul, no faster than flash attention on AMD CPUs, so a float32 cache keeps flash
attention, group by group, which computes its scores in float32.

Groups are batched in order of size, padded to the largest rows and prefix of their batch (padded
rows are dropped, padded prefix positions masked), each batch's scores bounded by SCORES_LIMIT
elements; a group larger than that alone goes through flash attention, whose memory is bounded.

Where the native kernels are built (`cpu_native`), the groups can also go in one `span_attention`
call, each group a span of rows over its prefix blocks, in float32 and bfloat16: on an AMD EPYC
without AVX-512 it ran a step of 8 groups of 32 decodes over 512 tokens in 3.5 ms, flash attention in
4.9 and the batched path (bfloat16 emulated) in 84.

Which is fastest depends on the CPU: on an Intel Xeon with AMX, flash attention group by group ran
the shared-prefix workload ~10% faster end to end than the batched path. So `prefix_kernel` times
those this CPU and dtype can run once per process and shape on a synthetic step (`calibrate`: 8
groups of 32 decodes over 512 tokens) and keeps the fastest; PAGEDBATCH_CPU_PREFIX=native, =batched
or =flash fixes it (flash where the one named cannot run).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from pagedbatch_kernels import startup
from pagedbatch_kernels.compiled import Compiled
from pagedbatch_kernels.cpu import cpu_native
from pagedbatch_kernels.cpu.cpu_prefill import fastest
from settings import EngineSettings, value

log = logging.getLogger(__name__)

SCORES_LIMIT = 1 << 22  # scores of one batched call (x2 bytes, plus as many float32 in the softmax)
MAX_PADDING = 2.0  # a batch computes at most this many times its groups' own scores
BATCHED_DTYPES = (torch.bfloat16,)  # caches whose groups may be batched; the others go group by group
CHOICE_ENV = "PAGEDBATCH_CPU_PREFIX"
CALIBRATION = (8, 32, 512)  # groups x decodes x prefix tokens: a step of the shared-prefix workload
KERNELS = ("native", "batched", "flash")
_choices: dict[tuple, str] = {}
_choice_lock = threading.Lock()


def prefix_attention(query, k_cache, v_cache, prefix_blocks, scale):
    """The attention of every row of `query` over `prefix_blocks`, which they all share, and its
    log-sum-exp, both float32. Per KV head, every row's queries of that head are one block of queries
    against the prefix: one call of PyTorch's CPU flash attention, which also returns the log-sum-exp."""
    rows, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group, length = num_heads // num_kv_heads, prefix_blocks.shape[0] * block_size
    keys = k_cache.index_select(0, prefix_blocks).view(1, length, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, prefix_blocks).view(1, length, num_kv_heads, head_dim).transpose(1, 2)
    queries = (
        query.view(rows, num_kv_heads, group, head_dim).transpose(0, 1).reshape(1, num_kv_heads, rows * group, head_dim)
    )
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries, keys, values, 0.0, False, scale=scale
    )[:2]
    out = out.view(num_kv_heads, rows, group, head_dim).transpose(0, 1).reshape(rows, num_heads, head_dim)
    lse = lse.view(num_kv_heads, rows, group).transpose(0, 1).reshape(rows, num_heads)
    return out.float(), lse


def softmax_and_lse(scaled, dtype):
    """softmax(scaled) along the last dimension in `dtype`, and its log-sum-exp in float32."""
    top = scaled.amax(-1, keepdim=True)
    weights = torch.exp(scaled - top)
    total = weights.sum(-1, keepdim=True)
    return (weights / total).to(dtype), (top + total.log()).squeeze(-1)


def weights_and_lse(scores, scale, bias):
    """softmax(scores * scale + bias) along the last dimension in the scores' dtype, and its
    log-sum-exp in float32; `bias` (-inf past a shorter prefix, 0 elsewhere) broadcasts over rows."""
    return softmax_and_lse(scores.float() * scale + bias, scores.dtype)


_weights_and_lse = Compiled(weights_and_lse, varying={0: (0, 1, 2), 2: (0, 2)})


@dataclass
class PrefixBatch:
    """Groups computed in one batched call: `rows` [n, R] their rows (row 0 where a group has fewer
    than R), `blocks` [n, W] their prefix blocks (block 0 past a shorter prefix), `bias` [n x KV heads,
    1, W x block size] -inf past each group's prefix and 0 elsewhere, `picks` where each real row lies
    among the n x R."""

    rows: torch.Tensor
    blocks: torch.Tensor
    bias: torch.Tensor
    picks: torch.Tensor


@dataclass
class PrefixPlan:
    """How a step's bfloat16 groups are computed: in `batches`, and the groups in none (`alone`) by
    flash attention; `order` takes the rows so computed back to row order."""

    groups: list[tuple[int, int, torch.Tensor]]
    batches: list[PrefixBatch]
    alone: list[int]
    order: torch.Tensor

    def run(self, query, k_cache, v_cache, scale) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [batched_prefix_attention(query, k_cache, v_cache, batch, scale) for batch in self.batches]
        parts += [
            prefix_attention(query[start:end], k_cache, v_cache, blocks, scale)
            for start, end, blocks in (self.groups[g] for g in self.alone)
        ]
        out, lse = (torch.cat(p) for p in zip(*parts))
        return out[self.order], lse[self.order]


def grouped_prefix_attention(query, k_cache, v_cache, groups, scale, plan: PrefixPlan | cpu_native.Spans | None = None):
    """The prefix attention and log-sum-exp of every row of `query`, in row order, for `groups`
    (first row, end row, shared blocks) that cover the rows in order; `plan` (from `plan_for`) takes
    them to the batched path or the native kernel, None to flash attention group by group."""
    if plan is None or (isinstance(plan, PrefixPlan) and k_cache.dtype not in BATCHED_DTYPES):
        outs, lses = zip(
            *(prefix_attention(query[start:end], k_cache, v_cache, blocks, scale) for start, end, blocks in groups)
        )
        return torch.cat(outs), torch.cat(lses)
    return plan.run(query, k_cache, v_cache, scale)


def plan_for(
    kernel: str, groups: list[tuple[int, int, torch.Tensor]], num_heads: int, num_kv_heads: int, block_size: int
) -> PrefixPlan | cpu_native.Spans | None:
    """The plan of `groups` for `kernel` (one of KERNELS)."""
    if kernel == "batched":
        return plan_prefixes(groups, num_heads, num_kv_heads, block_size)
    if kernel == "native":
        return cpu_native.plan_spans(
            [blocks.tolist() for _, _, blocks in groups],
            [end - start for start, end, _ in groups],
            [blocks.shape[0] * block_size for start, end, blocks in groups for _ in range(start, end)],
            groups[0][2].device,
        )
    return None


def plan_prefixes(
    groups: list[tuple[int, int, torch.Tensor]], num_heads: int, num_kv_heads: int, block_size: int
) -> PrefixPlan:
    """Batches of groups of similar size, within SCORES_LIMIT and MAX_PADDING."""
    sizes = [(end - start, blocks.shape[0] * block_size) for start, end, blocks in groups]  # rows, prefix
    alone = [g for g, (rows, length) in enumerate(sizes) if rows * num_heads * length > SCORES_LIMIT]
    batches, current = [], []
    for g in sorted(set(range(len(groups))) - set(alone), key=lambda g: (sizes[g][1], sizes[g][0])):
        trial = current + [g]
        padded = len(trial) * max(sizes[i][0] for i in trial) * max(sizes[i][1] for i in trial)
        if current and (
            padded * num_heads > SCORES_LIMIT or padded > MAX_PADDING * sum(sizes[i][0] * sizes[i][1] for i in trial)
        ):
            batches.append(current)
            trial = [g]
        current = trial
    if current:
        batches.append(current)
    device = groups[0][2].device
    row_order = [r for g in [g for members in batches for g in members] + alone for r in range(*groups[g][:2])]
    order = torch.empty(len(row_order), dtype=torch.long)
    order[torch.tensor(row_order)] = torch.arange(len(row_order))
    planned = [_batch([groups[g] for g in members], num_kv_heads, block_size, device) for members in batches]
    return PrefixPlan(groups, planned, alone, order.to(device))


def _batch(members: list[tuple[int, int, torch.Tensor]], num_kv_heads: int, block_size: int, device) -> PrefixBatch:
    width = max(blocks.shape[0] for _, _, blocks in members)
    height = max(end - start for start, end, _ in members)
    # a single matrix would be compiled apart (a size of one is specialised): compute the group twice
    computed = members * 2 if len(members) * num_kv_heads == 1 else members
    rows = [list(range(start, end)) + [0] * (height - (end - start)) for start, end, _ in computed]
    tables = [blocks.tolist() + [0] * (width - blocks.shape[0]) for _, _, blocks in computed]
    picks = [i * height + r for i, (start, end, _) in enumerate(members) for r in range(end - start)]
    # made in its final shape: a view's base would be guarded too (one of size 1 compiled apart)
    lengths = torch.tensor(
        [blocks.shape[0] * block_size for _, _, blocks in computed for _ in range(num_kv_heads)], device=device
    )
    past_end = torch.arange(width * block_size, device=device)[None, None, :] >= lengths[:, None, None]
    return PrefixBatch(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        blocks=torch.tensor(tables, dtype=torch.long, device=device),
        bias=torch.zeros(past_end.shape, device=device).masked_fill(past_end, float("-inf")),
        picks=torch.tensor(picks, dtype=torch.long, device=device),
    )


def batched_prefix_attention(query, k_cache, v_cache, batch: PrefixBatch, scale):
    """`prefix_attention` of every group of `batch` at once: as [groups x KV heads] matrices of
    [rows x query heads per KV head] queries against [prefix] keys. Returns the rows in batch order."""
    count, height = batch.rows.shape
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group, length = num_heads // num_kv_heads, batch.blocks.shape[1] * block_size
    queries = (
        query[batch.rows]
        .view(count, height, num_kv_heads, group, head_dim)
        .transpose(1, 2)
        .reshape(count * num_kv_heads, height * group, head_dim)
    )
    blocks = batch.blocks.flatten()  # index_select copies whole blocks (~5x faster than indexing by [n, W])
    keys = k_cache.index_select(0, blocks).view(count, length, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, blocks).view(count, length, num_kv_heads, head_dim).transpose(1, 2)
    scores = torch.bmm(queries, keys.reshape(count * num_kv_heads, length, head_dim).transpose(1, 2))
    weights, lse = _weights_and_lse(scores, scale, batch.bias)
    out = torch.bmm(weights, values.reshape(count * num_kv_heads, length, head_dim))
    out = (
        out.view(count, num_kv_heads, height, group, head_dim)
        .transpose(1, 2)
        .reshape(count * height, num_heads, head_dim)
    )
    lse = lse.view(count, num_kv_heads, height, group).transpose(1, 2).reshape(count * height, num_heads)
    return out[batch.picks].float(), lse[batch.picks]


def usable(kernel: str, dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    if kernel == "native":
        return cpu_native.takes(dtype, num_heads, num_kv_heads, head_dim)
    return kernel == "flash" or dtype in BATCHED_DTYPES


def prefix_kernel(dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> str:
    """Which of KERNELS computes a step's groups over a cache of `dtype`: the fastest of those usable
    here (timed once per shape), or the one PAGEDBATCH_CPU_PREFIX names."""
    fixed = value(EngineSettings, "cpu_prefix")  # one of KERNELS, checked there
    if fixed:
        return fixed if usable(fixed, dtype, num_heads, num_kv_heads, head_dim) else "flash"
    if startup.quick():  # no timing: the span kernel where it is built, else flash attention
        return "native" if usable("native", dtype, num_heads, num_kv_heads, head_dim) else "flash"
    key = (dtype, num_heads, num_kv_heads, head_dim, block_size)
    if key not in _choices:  # asked at every step: the lock only until the choice is made
        with _choice_lock:
            if key not in _choices:
                _choices[key] = calibrate(*key)
                log.info("CPU shared-prefix attention for %s: %s", key, _choices[key])
    return _choices[key]


def synthetic_groups(
    groups: int, rows: int, prefix: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype
):
    """Random queries, caches and `groups` spans of `rows` rows sharing `prefix` tokens of blocks each."""
    blocks = prefix // block_size
    shape = (groups * blocks + 1, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    pool = torch.randperm(shape[0])
    spans = [(g * rows, (g + 1) * rows, pool[g * blocks : (g + 1) * blocks]) for g in range(groups)]
    return torch.randn(groups * rows, num_heads, head_dim).to(dtype), k_cache, v_cache, spans


@torch.no_grad()
def calibrate(dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, repeats: int = 3) -> str:
    """The fastest of the KERNELS usable here on the CALIBRATION step (flash where it is the only one)."""
    kernels = [k for k in KERNELS if usable(k, dtype, num_heads, num_kv_heads, head_dim)]
    if len(kernels) == 1:
        return kernels[0]
    query, k_cache, v_cache, spans = synthetic_groups(
        *CALIBRATION, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    plans = {k: plan_for(k, spans, num_heads, num_kv_heads, block_size) for k in kernels}
    runs = {
        k: lambda plan=plans[k]: grouped_prefix_attention(query, k_cache, v_cache, spans, scale, plan) for k in kernels
    }
    return fastest(runs, repeats)
