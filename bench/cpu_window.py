"""Windowed and soft-capped attention on CPU: the native banded kernels (`cpu_window`, what the engine
runs now) against the plain-torch reference (what windowed and capped layers ran before), one layer's
call, in one process, alternating, best of --repeats.

    python -m bench.cpu_window [--repeats 5]

Shapes: 8 query and 4 KV heads of 64, 16-token blocks,
float32 pool; steps: 64 decodes at contexts of 1-4k tokens, one 2k-token prompt, and 8 chunks of 32
tokens after 1k-token cached prefixes; windows 256 / none, caps none / 50.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagedbatch_kernels import reference
from pagedbatch_kernels.cpu import cpu_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16
STEPS = {
    "64 decodes, 1-4k context": [(random.Random(i).randint(1000, 4000), 1) for i in range(64)],
    "one 2k prompt": [(2048, 2048)],
    "8 chunks of 32 after 1k": [(1024 + 32, 32)] * 8,
}
CASES = [(256, None), (256, 50.0), (None, 50.0)]


def step_tensors(step, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK) for n, _ in step)
    num_blocks = len(step) * width
    starts = [0]
    for _, q in step:
        starts.append(starts[-1] + q)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return dict(
        query=torch.randn(starts[-1], HEADS, HEAD_DIM, generator=gen),
        k_cache=torch.randn(shape, generator=gen),
        v_cache=torch.randn(shape, generator=gen),
        block_tables=torch.randperm(num_blocks, generator=gen).view(len(step), width).int(),
        seq_lens=torch.tensor([n for n, _ in step], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        scale=HEAD_DIM**-0.5,
    )


def best(run, repeats):
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| step | window | cap | reference ms | native ms | speed-up | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with torch.no_grad():
        for name, step in STEPS.items():
            call = step_tensors(step)
            for window, cap in CASES:
                kw = dict(window=window, softcap=cap)
                ref = best(lambda c=call, k=kw: reference.paged_attention(**c, **k), args.repeats)
                ours = best(lambda c=call, k=kw: cpu_attention.paged_attention(**c, **k), args.repeats)
                diff = (cpu_attention.paged_attention(**call, **kw) - reference.paged_attention(**call, **kw)).abs()
                print(
                    f"| {name} | {window or '-'} | {cap or '-'} | {ref * 1e3:.1f} | {ours * 1e3:.1f} |"
                    f" {ref / ours:.2f}x | {diff.max().item():.1e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
