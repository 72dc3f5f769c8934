"""The CPU engine's per-token kernels through the native library (`csrc/cpu_pointwise.cpp`): each of
`pagedbatch_kernels.reference`'s RMSNorm, rotary, SiLU-and-multiply (float32) and KV-cache write as one
C++ pass, the rows shared among torch's OpenMP threads where there are enough of them. torch ran
them as a handful of ops at ~10 us of dispatch each (100-250 us a call for ~1 us of a decode step's
arithmetic; compiled, dynamo's guards cost as much): ~19% of the mixed workload's float32 run on a
2-core AMD EPYC, 10% less run time through these. `compiled` says, per dtype, up to which size each
goes here rather than to inductor. Same contracts and arithmetic as the reference (float32 inside,
each product and sum rounded as torch's; SiLU's exp within ~1 ulp of torch's); tensors the kernels
do not take (other dtypes or devices, other layouts, no native library) go to the reference."""

from __future__ import annotations

import torch

from pagedbatch_kernels import reference
from pagedbatch_kernels.cpu import cpu_native

DTYPES = (torch.float32, torch.bfloat16)


def _library(*tensors: torch.Tensor):
    """The native library where it is built and takes these tensors: CPU, one of DTYPES, all alike."""
    dtype = tensors[0].dtype
    if dtype not in DTYPES or any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        return None
    return cpu_native.library()


def _bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def rms_norm(x, weight, eps):
    lib = _library(x, weight)
    if lib is None or weight.shape != x.shape[-1:]:
        return reference.rms_norm(x, weight, eps)
    x = x.contiguous()  # Qwen3's per-head q/k norms get views of the fused projection: one copy, not torch's ops
    out = torch.empty_like(x)
    lib.pb_rms_norm(
        x.data_ptr(),
        None,
        weight.contiguous().data_ptr(),
        out.data_ptr(),
        None,
        x.numel() // x.shape[-1],
        x.shape[-1],
        float(eps),
        _bf16(x),
    )
    return out


def fused_add_rms_norm(x, residual, weight, eps):
    lib = _library(x, residual, weight)
    if (
        lib is None
        or not (x.is_contiguous() and residual.is_contiguous())
        or residual.shape != x.shape
        or weight.shape != x.shape[-1:]
    ):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    out, total = torch.empty_like(x), torch.empty_like(x)
    lib.pb_rms_norm(
        x.data_ptr(),
        residual.data_ptr(),
        weight.contiguous().data_ptr(),
        out.data_ptr(),
        total.data_ptr(),
        x.numel() // x.shape[-1],
        x.shape[-1],
        float(eps),
        _bf16(x),
    )
    return out, total


def silu_and_mul(x):
    """float32 only: the native bfloat16 one ran slower than torch's."""
    lib = _library(x)
    if lib is None or x.dtype != torch.float32 or not x.is_contiguous() or x.shape[-1] % 2:
        return reference.silu_and_mul(x)
    size = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], size), dtype=x.dtype)
    lib.pb_silu_and_mul(x.data_ptr(), x.numel() // x.shape[-1], size, out.data_ptr())
    return out


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with each token's heads laid out one after another."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def apply_rotary(query, key, positions, cos_sin_cache):
    lib = _library(query, key)
    if (
        lib is None
        or not (_heads_contiguous(query) and _heads_contiguous(key))
        or query.shape[2] % 2
        or positions.dtype != torch.int64
        or cos_sin_cache.dtype != torch.float32
        or cos_sin_cache.shape[1] != query.shape[2]
        or key.shape[2] != query.shape[2]
    ):
        return reference.apply_rotary(query, key, positions, cos_sin_cache)
    positions, table = positions.contiguous(), cos_sin_cache.contiguous()
    rotated = []
    for x in (query, key):
        out = torch.empty(x.shape, dtype=x.dtype)
        status = lib.pb_rotary(
            x.data_ptr(),
            x.stride(0),
            positions.data_ptr(),
            table.data_ptr(),
            table.shape[0],
            x.shape[0],
            x.shape[1],
            x.shape[2],
            out.data_ptr(),
            _bf16(x),
        )
        if status != 0:
            raise IndexError(f"a position is past the rotary table's {table.shape[0]} positions")
        rotated.append(out)
    return rotated[0], rotated[1]


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    lib = _library(key, value, k_cache, v_cache)
    if (
        lib is None
        or not (_heads_contiguous(key) and _heads_contiguous(value))
        or key.shape != value.shape
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or k_cache.shape != v_cache.shape
        or k_cache.shape[2:] != key.shape[1:]
        or slot_mapping.dtype != torch.int64
    ):
        return reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    slots = slot_mapping.contiguous()
    status = lib.pb_write_kv(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        key.shape[0],
        k_cache.shape[0] * k_cache.shape[1],
        key.shape[1] * key.shape[2],
        key.element_size(),
    )
    if status != 0:
        raise IndexError(f"a slot is past the cache's {k_cache.shape[0] * k_cache.shape[1]} slots")
