"""The one place where the engine chooses between plain-torch and Triton kernels.

Every model layer calls the functions of an `Ops` object; `select_ops(backend, device)`
returns the torch reference set (runs anywhere), the same compiled by inductor with a paged decode
attention that reads the pool in place (the CPU engine's), or the Triton set (CUDA, or CPU through
TRITON_INTERPRET=1). Both take the arguments of `pagedbatch_kernels.reference`; what a set can do
beyond that, the engine learns from its capability flags, never from its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pagedbatch_kernels import compiled, reference
from pagedbatch_kernels.cpu import cpu_attention, cpu_pointwise


@dataclass(frozen=True)
class Ops:
    name: str  # a label; the engine decides by the flags below
    # paged_attention takes host-side hints (max_query_len, max_seq_len, an `out` buffer):
    # bounds the host already knows spare the kernel from assuming the worst.
    attention_hints: bool
    # No kernel reads device memory on the host, so a whole step can be captured in a CUDA graph.
    graph_capturable: bool
    # Kernels compile on first use, per shape kind: the runner warms them up at load.
    compiles_on_first_use: bool
    write_kv_cache: Callable
    paged_attention: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable
    # The mixture-of-experts experts in one fused kernel (moe_align's signature), where the set has one;
    # without it the model groups the rows by expert itself (engine/models/moe.py).
    fused_moe: Callable | None = None
    # The GEMM on quantized weights (pagedbatch_kernels.lora_quant.quant_matmul's signature), where the set has one;
    # without it quantized layers dequantize their weight per matmul (quant_reference's twin).
    quant_matmul: Callable | None = None


TORCH_OPS = Ops(
    name="torch",
    attention_hints=False,
    graph_capturable=False,  # the reference attention reads sequence lengths on the host
    compiles_on_first_use=False,
    write_kv_cache=reference.write_kv_cache,
    paged_attention=reference.paged_attention,
    rms_norm=reference.rms_norm,
    fused_add_rms_norm=reference.fused_add_rms_norm,
    apply_rotary=reference.apply_rotary,
    silu_and_mul=reference.silu_and_mul,
)


CPU_OPS = replace(
    TORCH_OPS,
    name="torch-compiled",
    compiles_on_first_use=True,
    write_kv_cache=cpu_pointwise.write_kv_cache,
    paged_attention=cpu_attention.paged_attention,
    rms_norm=compiled.rms_norm,
    fused_add_rms_norm=compiled.fused_add_rms_norm,
    apply_rotary=cpu_pointwise.apply_rotary,  # native at every size and dtype: never compiled
    silu_and_mul=compiled.silu_and_mul,
)


def triton_ops() -> Ops:
    from pagedbatch_kernels import triton_ops as t  # imported lazily: triton is optional on CPU
    from pagedbatch_kernels.lora_quant.quant_matmul import quant_matmul

    return Ops(
        name="triton",
        attention_hints=True,
        graph_capturable=True,
        compiles_on_first_use=False,  # Triton compiles too, but its launches are cached by shape class
        write_kv_cache=t.write_kv_cache,
        paged_attention=t.paged_attention,
        rms_norm=t.rms_norm,
        fused_add_rms_norm=t.fused_add_rms_norm,
        apply_rotary=t.apply_rotary,
        silu_and_mul=t.silu_and_mul,
        fused_moe=t.fused_moe,
        quant_matmul=quant_matmul,
    )


def select_ops(backend: str, device: torch.device) -> Ops:
    """backend: "torch", "triton", "compiled" or "auto" (Triton on CUDA, compiled on the CPU)."""
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "compiled"
    if backend == "torch":
        return TORCH_OPS
    if backend == "compiled":
        return CPU_OPS
    if backend == "triton":
        return triton_ops()
    raise ValueError(f"unknown attention backend {backend!r}; expected 'auto', 'torch', 'compiled' or 'triton'")
