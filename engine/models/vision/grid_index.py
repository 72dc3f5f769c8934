"""Qwen2.5-VL's per-image index tensors (rotary position ids, the window order and window boundaries) for a
batch of images, from a cache by patch grid: transformers' `vision_utils` helpers build them image by image
in Python at every call (a quarter of the tiny bench tower's time for 36 images); here each grid's are built
once by those same helpers and offset into place, and the tower takes them precomputed (its `kwargs`)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1024)
def _one_image(grid: tuple[int, int, int], merge: int, window: int, patch: int):
    from transformers import vision_utils

    thw = torch.tensor([grid])
    position_ids = vision_utils.get_vision_position_ids(thw, merge)
    window_index, cu_windows = vision_utils.get_vision_window_index(thw, merge, window, patch)
    return position_ids, window_index, cu_windows


def precomputed(grid_thw: torch.Tensor, merge: int, window: int, patch: int) -> dict:
    """`position_ids`, `window_index` and `cu_window_seqlens` for the images of `grid_thw`, equal to what the
    tower's helpers compute for the whole batch."""
    positions, indices, bounds = [], [], [torch.zeros(1, dtype=torch.int32)]
    merged = patches = 0  # merged tokens and patches of the images before this one
    for grid in map(tuple, grid_thw.tolist()):
        position_ids, window_index, cu_windows = _one_image(grid, merge, window, patch)
        positions.append(position_ids)
        indices.append(window_index + merged)
        bounds.append(cu_windows[1:] + patches)
        count = grid[0] * grid[1] * grid[2]
        merged += count // merge**2
        patches += count
    return {
        "position_ids": torch.cat(positions).to(grid_thw.device),
        "window_index": torch.cat(indices).to(grid_thw.device),
        "cu_window_seqlens": torch.unique_consecutive(torch.cat(bounds)).to(grid_thw.device),
    }
