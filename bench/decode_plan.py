"""Decode steps over shared prefixes on the CPU, two tables.

1. Host time to plan a step's attention (`cpu_attention.plan_decodes`, once per step): the shortcut over arrays
   (`cpu_decode_shortcut`) against the general per-row planning, side by side, on decode steps whose rows share
   nothing, one system prompt, one of four, or a picture in pairs (the two plans checked to be the same calls
   first), and on steps of prompts of 30 tokens (the native span kernel's chunks), with and without decodes.
2. Whether a shared prefix should go apart (`cpu_attention.SHARING_BOUNDS`): two layers' attention of a step
   whose rows all share one prefix, the prefix read once per group and merged against every row whole through
   the decode kernel, by rows, prefix length, heads and dtype, and what the engine's bounds choose.

    python -m bench.decode_plan [--rows 48,256] [--repeat 200] [--skip-attention]

Block size 16; each row's own blocks after its prompt's shared ones; lengths vary within one block, as in a
batch started together.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.vision import cpu_name
from pagedbatch_kernels.cpu import cpu_attention

BLOCK = 16
HEADS = (6, 2)
# (name, groups of rows sharing a prompt (0: nothing shared), shared blocks, own blocks)
CASES = [
    ("nothing shared", 0, 0, 4),
    ("one system prompt", 1, 16, 4),
    ("four system prompts", 4, 32, 4),
    ("pairs repeating a picture", -2, 2, 4),  # -n: groups of n rows
]


def step(rows: int, groups: int, shared: int, own: int):
    groups = rows // -groups if groups < 0 else groups
    tables = torch.zeros(rows, shared + own + 1, dtype=torch.int32)
    prompts = torch.arange(max(groups, 1) * shared).view(max(groups, 1), shared)
    fresh = max(groups, 1) * shared
    for r in range(rows):
        if groups:
            tables[r, :shared] = prompts[r % groups]
        tables[r, shared : shared + own] = torch.arange(fresh, fresh + own)
        fresh += own
    lengths = torch.tensor([(shared + own - 1) * BLOCK + 1 + r % BLOCK for r in range(rows)], dtype=torch.int32)
    return tables, lengths, torch.arange(rows + 1, dtype=torch.int32)


def prompt_step(prompts: int, tokens: int, decodes: int):
    """`prompts` fresh prompt chunks of `tokens` tokens, then `decodes` decodes of 60 tokens of context."""
    q_lens = [tokens] * prompts + [1] * decodes
    lengths = torch.tensor([tokens] * prompts + [61] * decodes, dtype=torch.int32)
    width = -(-int(lengths.max()) // BLOCK) + 1
    tables = torch.arange(len(q_lens) * width, dtype=torch.int32).view(len(q_lens), width)
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return tables, lengths, starts


def per_step(plan, repeat: int, rounds: int = 5) -> float:
    plan()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            plan()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def general_plan(*args):
    return cpu_attention.plan_decodes(*args, shortcut=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="48,256")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--skip-attention", action="store_true", help="only the planning table")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; ms per decode step to plan its attention calls (best of 5 x {args.repeat})")
    print("| rows | step | shortcut ms | general ms | general / shortcut |")
    print("| --- | --- | --- | --- | --- |")
    for rows in [int(r) for r in args.rows.split(",")]:
        for name, groups, shared, own in CASES:
            call = (*step(rows, groups, shared, own), BLOCK, HEADS)
            call += (False, cpu_attention.SHARING_BOUNDS[False])  # float32's bounds, as the engine plans
            fast, slow = cpu_attention.plan_decodes(*call), general_plan(*call)
            assert [len(c.prefixes) for c in fast.calls] == [len(c.prefixes) for c in slow.calls], name
            ours = per_step(lambda call=call: cpu_attention.plan_decodes(*call), args.repeat)
            theirs = per_step(lambda call=call: general_plan(*call), args.repeat)
            print(f"| {rows} | {name} | {ours * 1e3:.3f} | {theirs * 1e3:.3f} | {theirs / ours:.1f}x |")
    for prompts, decodes in ((200, 0), (100, 100)):  # prompt steps: chunks of 30 tokens through the span kernel
        call = (*prompt_step(prompts, 30, decodes), BLOCK, HEADS, True, cpu_attention.SHARING_BOUNDS[False])
        ours = per_step(lambda call=call: cpu_attention.plan_decodes(*call), 20)
        theirs = per_step(lambda call=call: general_plan(*call), 2)
        name = f"{prompts} prompts of 30 tokens" + (f", {decodes} decodes" if decodes else "")
        print(f"| {prompts * 30 + decodes} | {name} | {ours * 1e3:.3f} | {theirs * 1e3:.3f} | {theirs / ours:.1f}x |")
    if not args.skip_attention:
        attention_table()


# (rows, shared prefix blocks, query heads, KV heads, head size)
ATTENTION_CASES = [
    (48, 1, 4, 2, 16),
    (48, 8, 6, 2, 64),
    (256, 8, 6, 2, 64),
    (256, 16, 6, 2, 64),
    (64, 32, 6, 2, 64),
    (256, 64, 6, 2, 64),
    (64, 32, 32, 8, 128),
    (16, 128, 32, 8, 128),
]


def attention_table() -> None:
    print("\nms for two layers' attention of a decode step whose rows share one prefix (best of 7 x 10)")
    print("| rows | shared tokens | heads (q/kv x size) | dtype | prefix apart | whole | engine goes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        for rows, shared, heads, kv_heads, size in ATTENTION_CASES:
            apart, whole, choice = attention_times(rows, shared, heads, kv_heads, size, dtype)
            print(
                f"| {rows} | {shared * BLOCK} | {heads}/{kv_heads} x {size} | {str(dtype).removeprefix('torch.')} "
                f"| {apart * 1e3:.2f} | {whole * 1e3:.2f} | {choice} |"
            )


def attention_times(rows, shared, heads, kv_heads, size, dtype) -> tuple[float, float, str]:
    """(seconds with the prefix apart, seconds whole, what the engine's bounds choose)."""
    tables, lengths, starts = step(rows, 1, shared, 2)
    k_cache = torch.randn(int(tables.max()) + 1, BLOCK, kv_heads, size).to(dtype)
    v_cache, query = torch.randn_like(k_cache), torch.randn(rows, heads, size).to(dtype)

    def two_layers():
        lengths.add_(0)  # a new step: planned again
        for _ in range(2):
            cpu_attention.paged_attention(query, k_cache, v_cache, tables, lengths, starts, size**-0.5)

    bounds, times = cpu_attention.SHARING_BOUNDS, []
    for forced in (cpu_attention.SHARE_ANY, (1 << 40, 0)):
        cpu_attention.SHARING_BOUNDS = {True: forced, False: forced}
        try:
            times.append(per_step(two_layers, 10, rounds=7))
        finally:
            cpu_attention.SHARING_BOUNDS = bounds
    positions, spared = cpu_attention.sharing_bounds(k_cache)
    apart = shared * BLOCK >= positions and (rows - 1) * shared * BLOCK >= spared
    return times[0], times[1], "apart" if apart else "whole"


if __name__ == "__main__":
    main()
