"""Qwen2.5-VL's batched window attention (engine/models/vision/attention.py) against one attention call
per run, and the patched tower against transformers' own on a tiny random tower."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.vision.attention import batch_windows, varlen_attention
from engine.models.vision.grid_index import precomputed


def test_varlen_attention_matches_one_call_per_run():
    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 5, 5, 21, 22, 30])  # a zero-length run and a single-token one
    q, k, v = (torch.randn(30, 2, 8) for _ in range(3))
    expected = torch.cat(
        [
            F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), scale=0.3
            ).transpose(0, 1)
            for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())
            if b > a
        ]
    )
    torch.testing.assert_close(varlen_attention(q, k, v, cu_seqlens, 0.3), expected, rtol=1e-5, atol=1e-6)


def test_patched_tower_matches_transformers():
    from transformers import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLVisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        window_size=16,
        out_hidden_size=24,
        fullatt_block_indexes=[1],
    )
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config).eval()
    grid = torch.tensor([[1, 6, 10], [1, 8, 4]])  # windows of 4 x 4 patches: partial ones at the edges
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4)
    with torch.no_grad():
        expected = tower(pixels, grid_thw=grid).pooler_output
        batch_windows(tower)
        ours = tower(pixels, grid_thw=grid).pooler_output
        indices = precomputed(grid, tower.spatial_merge_size, tower.window_size, tower.patch_size)
        with_indices = tower(pixels, grid_thw=grid, **indices).pooler_output
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(with_indices, ours)


def test_grid_indices_equal_the_helpers_over_the_whole_batch():
    """The per-grid cache of Qwen2.5-VL's index tensors, offset into place, gives exactly what transformers'
    helpers compute for the batch: grids that are and are not whole windows, repeated ones, a video-like
    t > 1, and one image alone."""
    from transformers import vision_utils

    gen = torch.Generator().manual_seed(3)
    batches = [torch.tensor([[1, 2, 2]]), torch.tensor([[2, 6, 10], [1, 8, 4], [1, 6, 10], [1, 2, 14]])]
    for _ in range(20):
        count = int(torch.randint(1, 12, (1,), generator=gen))
        batches.append(
            torch.cat([torch.ones(count, 1, dtype=torch.long), torch.randint(1, 12, (count, 2), generator=gen) * 2], 1)
        )
    for grid in batches:
        for merge, window, patch in ((2, 16, 4), (2, 112, 14)):
            got = precomputed(grid, merge, window, patch)
            positions = vision_utils.get_vision_position_ids(grid, merge)
            index, bounds = vision_utils.get_vision_window_index(grid, merge, window, patch)
            assert torch.equal(got["position_ids"], positions)
            assert torch.equal(got["window_index"], index)
            assert torch.equal(got["cu_window_seqlens"], bounds) and got["cu_window_seqlens"].dtype == bounds.dtype
