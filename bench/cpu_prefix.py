"""Decodes' attention over shared prefixes on the CPU (`pagedbatch_kernels.cpu.cpu_prefix`): PyTorch's flash
attention group by group against every group of the step in one batched matmul, in one run, on the
vs_vllm model's heads (6 query heads of 64 over 2 KV heads).

    python -m bench.cpu_prefix [--dtypes bfloat16,float32] [--repeat 20]

The engine batches bfloat16 only: this prints float32 too, to show why.
"""

from __future__ import annotations

import argparse

import torch

from bench.cpu_linear import seconds
from engine.runner.cpu_malloc import keep_freed_memory
from pagedbatch_kernels.cpu import cpu_prefix

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 16
# (groups, decodes per group, prefix tokens): the shared_prefix workload's step, fewer and longer, many small
CASES = [(8, 32, 512), (2, 64, 1024), (16, 4, 128), (4, 16, 2048)]


def case(groups: int, rows: int, prefix: int, dtype: torch.dtype):
    return cpu_prefix.synthetic_groups(groups, rows, prefix, HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print("| dtype | groups x decodes x prefix | flash per group us | batched us | flash / batched |")
    print("|---|---|---:|---:|---:|")
    scale = HEAD_DIM**-0.5
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for groups, rows, prefix in CASES:
            query, k_cache, v_cache, spans = case(groups, rows, prefix, dtype)
            args_ = (query, k_cache, v_cache)
            plan = cpu_prefix.plan_prefixes(spans, HEADS, KV_HEADS, BLOCK)
            flash = seconds(lambda a=args_, s=spans: cpu_prefix.grouped_prefix_attention(*a, s, scale), args.repeat)
            batched = seconds(lambda a=args_, p=plan: p.run(*a, scale), args.repeat)
            print(
                f"| {str(dtype)[6:]} | {groups} x {rows} x {prefix} | {flash * 1e6:,.0f} | {batched * 1e6:,.0f} "
                f"| {flash / batched:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    keep_freed_memory()  # as the engine does: without it each call's scores come from fresh pages
    with torch.no_grad():
        main()
