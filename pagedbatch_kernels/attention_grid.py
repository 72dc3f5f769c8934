"""Launch geometry of the paged attention kernels (`paged_attention`): block sizes, split counts."""

from __future__ import annotations

import functools

import torch
import triton


def _pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum): Triton block sizes must be powers of two."""
    return max(triton.next_power_of_2(max(int(n), 1)), minimum)


MAX_SPLITS = 32
MIN_SPLIT_TOKENS = 256  # on GPU, a partition shorter than this costs more in merging than it gains


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Flash-decoding partitions per decode, from shapes only: enough programs to fill the GPU."""
    if device.type == "cuda":
        target = 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        min_tokens = MIN_SPLIT_TOKENS
    else:  # the interpreter: split only long contexts, so that the path is exercised at all
        target, min_tokens = 4, 64
    programs = max(num_seqs * num_kv_heads, 1)
    return max(1, min(triton.cdiv(target, programs), max_context // min_tokens, MAX_SPLITS))


def _search_steps(num_seqs: int) -> int:
    """Binary-search steps over num_seqs, rounded up to a multiple of 4 to bound recompilation."""
    return -(-num_seqs.bit_length() // 4) * 4


def _block_config(
    head_dim_pad: int, group_pad: int, decode_only: bool, on_gpu: bool, fp32: bool
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for the query-block kernel."""
    block_n = 64 if head_dim_pad <= 128 else 32
    if decode_only:
        return max(16, group_pad), block_n, 4
    block_m = 128 if head_dim_pad <= 64 else 64 if head_dim_pad <= 128 else 32
    if fp32:  # twice the registers per element (fp32 is for tests; serving runs bf16)
        block_m, block_n = block_m // 2, max(block_n // 2, 16)
    if not on_gpu:
        block_m = 32  # the interpreter pays per element: keep padding rows few
    block_m = max(block_m, group_pad)
    return block_m, block_n, 8 if block_m >= 128 else 4
