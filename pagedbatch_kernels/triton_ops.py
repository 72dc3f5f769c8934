"""The Triton kernel set, with exactly the signatures of `pagedbatch_kernels.reference`."""

from pagedbatch_kernels import paged_attention as triton_attention
from pagedbatch_kernels import reference
from pagedbatch_kernels.activation import silu_and_mul
from pagedbatch_kernels.fused_moe import fused_moe
from pagedbatch_kernels.kv_cache import write_kv_cache
from pagedbatch_kernels.norm import fused_add_rms_norm, rms_norm
from pagedbatch_kernels.rotary import apply_rotary

__all__ = [
    "apply_rotary",
    "fused_add_rms_norm",
    "fused_moe",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv_cache",
]


def paged_attention(
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, *, sinks=None, out=None, **options
):
    """The Triton paged attention; layers with attention sinks (gpt-oss) take the torch reference,
    which has them (the Triton kernels do not yet), and ignore the kernel-only hints."""
    args = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    if sinks is None:
        return triton_attention.paged_attention(*args, out=out, **options)
    result = reference.paged_attention(*args, window=options.get("window"), softcap=options.get("softcap"), sinks=sinks)
    return result if out is None else out.copy_(result)
