"""Qwen2.5-VL's M-RoPE: rotary positions on three axes (temporal, height, width), each driving its
own slice of the rotary frequencies (`mrope_section`). A text token has the same position on all
three axes (plain RoPE); an image's tokens take (start, start + row, start + column) over its merged
patch grid, and the text after it resumes at start + max(rows, columns), as transformers'
`get_rope_index` lays them out. Tokens past the prompt (decode, or a recompute after preemption) sit
at their index plus the prompt's delta (its largest position + 1 - its length), transformers'
`rope_deltas`."""

from __future__ import annotations

import torch


def prompt_positions(length: int, images, merge_size: int) -> tuple[torch.Tensor, int]:
    """([3, length] positions of a prompt whose located `images` carry their grid, delta)."""
    pieces, next_pos, at = [], 0, 0
    for item in images:
        text = item.offset - at
        pieces.append(torch.arange(text).expand(3, -1) + next_pos)
        next_pos += text
        t, h, w = (int(v) for v in item.pixels["image_grid_thw"][0])
        h, w = h // merge_size, w // merge_size
        grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        pieces.append(torch.stack(grid).reshape(3, -1) + next_pos)
        next_pos += max(h, w)
        at = item.offset + item.length
    pieces.append(torch.arange(length - at).expand(3, -1) + next_pos)
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 - length


def step_positions(seqs, num_new_tokens, device) -> torch.Tensor | None:
    """[3, T] positions of a step's new tokens, or None when no sequence in it has M-RoPE positions.
    Rows past a prompt (every decode row) are plain integers: no tensor work per sequence."""
    if not any(seq.mm is not None and "mrope" in seq.mm.extra for seq in seqs):
        return None
    axes: tuple[list, list, list] = ([], [], [])
    for seq, n in zip(seqs, num_new_tokens):
        start = seq.num_computed_tokens
        prompt, delta = seq.mm.extra["mrope"] if seq.mm is not None and "mrope" in seq.mm.extra else (None, 0)
        inside = 0 if prompt is None else max(0, min(start + n, prompt.shape[1]) - start)
        tail = range(start + inside + delta, start + n + delta)
        for axis, rows in enumerate(axes):
            if inside:
                rows.extend(prompt[axis, start : start + inside].tolist())
            rows.extend(tail)
    return torch.tensor(axes, dtype=torch.long).to(device)


def mrope_cos_sin(table: torch.Tensor, positions: torch.Tensor, section) -> torch.Tensor:
    """Per-token rotary rows [T, rotary] from the 1-D `table` (cat(cos, sin) by position): frequency j
    takes its cos and sin at the position of the axis `section` assigns it."""
    axis = torch.repeat_interleave(torch.arange(3, device=table.device), torch.tensor(section, device=table.device))
    axis = torch.cat((axis, axis))  # the cos half, then the sin half
    rows = table[positions]  # [3, T, rotary]
    return rows.gather(0, axis.expand(1, positions.shape[1], -1)).squeeze(0)
