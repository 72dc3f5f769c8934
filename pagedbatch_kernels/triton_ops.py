"""The Triton kernel set, with exactly the signatures of `pagedbatch_kernels.reference`."""

from pagedbatch_kernels.activation import silu_and_mul
from pagedbatch_kernels.fused_moe import fused_moe
from pagedbatch_kernels.kv_cache import write_kv_cache
from pagedbatch_kernels.norm import fused_add_rms_norm, rms_norm
from pagedbatch_kernels.paged_attention import paged_attention
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
