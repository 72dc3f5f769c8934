"""The Triton kernel set, with exactly the signatures of `kernels.reference`."""

from kernels.activation import silu_and_mul
from kernels.kv_cache import write_kv_cache
from kernels.norm import fused_add_rms_norm, rms_norm
from kernels.paged_attention import paged_attention
from kernels.rotary import apply_rotary

__all__ = [
    "apply_rotary",
    "fused_add_rms_norm",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv_cache",
]
