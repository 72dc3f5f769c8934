"""Qwen2.5-VL's batched window attention (engine/models/vision/attention.py) against one attention call
per run, and the patched tower against transformers' own on a tiny random tower."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.vision.attention import batch_windows, varlen_attention


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
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
