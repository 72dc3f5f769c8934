"""Every kernel launch the wrappers make, compiled for Hopper (sm_90) by Triton's real compiler.

The interpreter that runs the numeric tests on CPU does not check what only the GPU compiler
checks (types of loop-carried values, dot shapes, layouts, shared memory). Compilation down
to a cubin needs no GPU, so a subprocess without TRITON_INTERPRET records the exact launches
(arguments, constexprs, num_warps) the host wrappers make for bf16, fp16 and fp32 inputs and
compiles each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedbatch_kernels import activation, kv_cache, norm, paged_attention, rotary

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
         torch.int32: "i32", torch.int64: "i64"}
LAUNCH_OPTIONS = ("num_warps", "num_stages")
launches = []


class Recorder:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))


paged_attention._compiled_for_gpu = lambda t: True  # the GPU launch configs, from CPU tensors
for module, names in [
    (paged_attention, ["_query_block_kernel", "_split_decode_kernel", "_merge_splits_kernel"]),
    (kv_cache, ["_write_kv_cache_kernel"]), (norm, ["_rms_norm_kernel"]),
    (rotary, ["_rotary_kernel"]), (activation, ["_silu_and_mul_kernel"]),
]:
    for name in names:
        setattr(module, name, Recorder(getattr(module, name)))


def arg_type(value):
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    return "fp32"


def compile_launch(fn, args, kwargs):
    values = dict(zip(fn.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    constexpr_names = {p.name for p in fn.params if p.is_constexpr}
    constexprs = {k: v for k, v in values.items() if k in constexpr_names}
    signature = {k: "constexpr" if k in constexpr_names else arg_type(values[k]) for k in fn.arg_names}
    # what the JIT would specialize on: 16-byte aligned pointers, integers divisible by 16
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in values.items()
             if k not in constexpr_names and ((isinstance(v, torch.Tensor) and v.data_ptr() % 16 == 0)
             or (type(v) is int and v % 16 == 0))}
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    assert kernel.metadata.shared <= 227 * 1024, (fn.__name__, kernel.metadata.shared)


bf16 = torch.bfloat16
for heads, head_dim, block_size, dtype in [((32, 8), 128, 16, bf16), ((16, 16), 64, 32, bf16),
                                           ((8, 1), 32, 16, bf16), ((8, 2), 128, 16, torch.float32),
                                           ((4, 4), 256, 16, torch.float16)]:
    num_heads, num_kv_heads = heads
    k_cache = torch.randn(64, block_size, num_kv_heads, head_dim, dtype=dtype)
    tables = torch.arange(64, dtype=torch.int32).view(4, 16)
    seq_lens = torch.tensor([300, 40, 17, 33], dtype=torch.int32)
    for q_lens, splits in [([1, 1, 1, 1], 1), ([1, 1, 1, 1], 8), ([100, 1, 17, 1], 4)]:
        starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        query = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype)
        paged_attention.paged_attention(query, k_cache, k_cache, tables, seq_lens, starts, 0.1,
                                        num_splits=splits)
    key = torch.randn(7, num_kv_heads, head_dim, dtype=dtype)
    kv_cache.write_kv_cache(key, key, k_cache, k_cache, torch.arange(7))
    rotary.apply_rotary(query, key, torch.arange(query.shape[0]), torch.randn(512, head_dim))
for hidden, dtype in [(64, bf16), (4096, bf16), (8192, torch.float32)]:
    x = torch.randn(5, hidden, dtype=dtype)
    norm.rms_norm(x, x[0], 1e-6)
    norm.fused_add_rms_norm(x, x, x[0], 1e-6)
    activation.silu_and_mul(torch.randn(5, 2 * hidden, dtype=dtype))

for fn, args, kwargs in launches:
    compile_launch(fn, args, kwargs)
print(f"compiled {len(launches)} launches")
"""


def _cuda_backend_available() -> bool:
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _cuda_backend_available(), reason="Triton's CUDA backend is not installed")
def test_all_launches_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "compiled" in proc.stdout
