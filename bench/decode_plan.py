"""Host time to plan a decode step's attention on the CPU (`cpu_attention.plan_decodes`, once per step): the
shortcut over arrays (`_decodes_only`) against the general per-row planning, side by side in one run, on decode
steps whose rows share nothing, share one system prompt, or share one of four.

    python -m bench.decode_plan [--rows 48,256] [--repeat 200]

Block size 16; each row's own blocks after its prompt's shared ones; lengths vary within one block, as in a
batch started together. The two plans are checked to be the same calls before they are timed.
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
CASES = [("nothing shared", 0, 0, 4), ("one system prompt", 1, 4, 4), ("four system prompts", 4, 8, 4)]


def step(rows: int, groups: int, shared: int, own: int):
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


def per_step(plan, repeat: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            plan()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def general_plan(*args):
    shortcut, cpu_attention._decodes_only = cpu_attention._decodes_only, lambda *a: None
    try:
        return cpu_attention.plan_decodes(*args)
    finally:
        cpu_attention._decodes_only = shortcut


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="48,256")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; ms per decode step to plan its attention calls (best of 5 x {args.repeat})")
    print("| rows | step | shortcut ms | general ms | general / shortcut |")
    print("| --- | --- | --- | --- | --- |")
    for rows in [int(r) for r in args.rows.split(",")]:
        for name, groups, shared, own in CASES:
            call = (*step(rows, groups, shared, own), BLOCK, HEADS)
            fast, slow = cpu_attention.plan_decodes(*call), general_plan(*call)
            assert [len(c.prefixes) for c in fast.calls] == [len(c.prefixes) for c in slow.calls], name
            ours = per_step(lambda call=call: cpu_attention.plan_decodes(*call), args.repeat)
            theirs = per_step(lambda call=call: general_plan(*call), args.repeat)
            print(f"| {rows} | {name} | {ours * 1e3:.3f} | {theirs * 1e3:.3f} | {theirs / ours:.1f}x |")


if __name__ == "__main__":
    main()
