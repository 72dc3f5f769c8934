"""Qwen2.5-VL's M-RoPE: rotary positions on three axes (temporal, height, width), each driving its
own slice of the rotary frequencies (`mrope_section`). A text token has the same position on all
three axes (plain RoPE); an image's tokens take (start, start + row, start + column) over its merged
patch grid, and the text after it resumes at start + max(rows, columns), as transformers'
`get_rope_index` lays them out. Tokens past the prompt (decode, or a recompute after preemption) sit
at their index plus the prompt's delta (its largest position + 1 - its length), transformers'
`rope_deltas`."""

from __future__ import annotations

import numpy as np
import torch


def prompt_positions(length: int, images, merge_size: int) -> tuple[torch.Tensor, int]:
    """([3, length] positions of a prompt whose located `images` carry their grid, delta)."""
    positions = np.empty((3, length), dtype=np.int64)  # numpy: a few microseconds an image, not torch's ~50
    next_pos, at = 0, 0
    for item in images:
        text = item.offset - at
        positions[:, at : item.offset] = np.arange(next_pos, next_pos + text)
        next_pos += text
        t, h, w = item.grid if item.grid is not None else (int(v) for v in item.pixels["image_grid_thw"][0])
        h, w = h // merge_size, w // merge_size
        grid = positions[:, item.offset : item.offset + t * h * w].reshape(3, t, h, w)
        grid[0] = next_pos + np.arange(t)[:, None, None]
        grid[1] = next_pos + np.arange(h)[None, :, None]
        grid[2] = next_pos + np.arange(w)[None, None, :]
        next_pos += max(h, w)
        at = item.offset + item.length
    positions[:, at:] = np.arange(next_pos, next_pos + length - at)
    return torch.from_numpy(positions), int(positions.max()) + 1 - length


def step_positions(seqs, num_new_tokens, device) -> torch.Tensor | None:
    """Positions of a step's new tokens, or None when no sequence in it has M-RoPE positions: [3, T]
    where a row lies inside an image prompt's layout, else [T] (every decode step: rows past a prompt sit
    at index + delta on all three axes, plain RoPE at that position, so no per-token rotary rows).
    A step whose every row is past its prompt is computed over the batch at once, not sequence by sequence."""
    layouts = [seq.mm.extra.get("mrope") if seq.mm is not None else None for seq in seqs]
    if not any(layouts):
        return None
    starts = [seq.num_computed_tokens for seq in seqs]
    if all(layout is None or start >= layout[0].shape[1] for start, layout in zip(starts, layouts)):
        deltas = torch.tensor([0 if layout is None else layout[1] for layout in layouts], dtype=torch.long)
        starts = torch.tensor(starts, dtype=torch.long) + deltas
        if min(num_new_tokens) == max(num_new_tokens) == 1:  # a decode step
            return starts.to(device)
        counts = torch.tensor(num_new_tokens, dtype=torch.long)
        firsts = torch.repeat_interleave(starts - (torch.cumsum(counts, 0) - counts), counts)
        return (firsts + torch.arange(int(counts.sum()))).to(device)
    inside = [
        0 if layout is None else max(0, min(start + n, layout[0].shape[1]) - start)
        for start, n, layout in zip(starts, num_new_tokens, layouts)
    ]
    axes: tuple[list, list, list] = ([], [], [])
    for seq, n, layout, count in zip(seqs, num_new_tokens, layouts, inside):
        start = seq.num_computed_tokens
        prompt, delta = layout if layout is not None else (None, 0)
        tail = range(start + count + delta, start + n + delta)
        for axis, rows in enumerate(axes):
            if count:
                rows.extend(prompt[axis, start : start + count].tolist())
            rows.extend(tail)
    return torch.tensor(axes, dtype=torch.long).to(device)


def mrope_cos_sin(table: torch.Tensor, positions: torch.Tensor, section) -> torch.Tensor:
    """Per-token rotary rows [T, rotary] from the 1-D `table` (cat(cos, sin) by position): frequency j
    takes its cos and sin at the position of the axis `section` assigns it."""
    axis = torch.repeat_interleave(torch.arange(3, device=table.device), torch.tensor(section, device=table.device))
    axis = torch.cat((axis, axis))  # the cos half, then the sin half
    rows = table[positions]  # [3, T, rotary]
    return rows.gather(0, axis.expand(1, positions.shape[1], -1)).squeeze(0)
