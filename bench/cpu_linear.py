"""GFLOP/s of the CPU linear layers: PyTorch's `F.linear` against `engine.runner.cpu_linear.PackedLinear`
(oneDNN on a weight packed once), on the shapes of the vs_vllm model, in one run.

    python -m bench.cpu_linear [--dtypes float32,bfloat16] [--repeat 30]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.runner.cpu_linear import PackedLinear

SHAPES = [(384, 640), (384, 2048), (1024, 384), (384, 6000)]  # (in, out): qkv, gate_up, down, lm_head
ROWS = [1, 48, 512, 2048]


def seconds(call, repeat: int) -> float:
    """The best of three timings of `call()` (after one warm-up call), per call."""
    call()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            call()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    print("| dtype | rows | in x out | F.linear GFLOP/s | packed GFLOP/s | packed / F.linear |")
    print("|---|---:|---|---:|---:|---:|")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for rows in ROWS:
            for k, n in SHAPES:
                linear = nn.Linear(k, n, bias=False).to(dtype)
                packed = PackedLinear(linear)
                x = torch.randn(rows, k, dtype=dtype)
                flop = 2 * rows * k * n / 1e9
                plain = seconds(lambda w=linear.weight, x=x: F.linear(x, w), args.repeat)
                ours = seconds(lambda p=packed, x=x: p(x), args.repeat)
                print(
                    f"| {str(dtype)[6:]} | {rows} | {k} x {n} | {flop / plain:,.0f} | {flop / ours:,.0f} "
                    f"| {plain / ours:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    with torch.no_grad():
        main()
