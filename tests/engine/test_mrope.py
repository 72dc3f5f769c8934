"""M-RoPE (engine/multimodal/mrope.py) against transformers' Qwen2.5-VL: the prompt's three-axis
positions and delta as `get_rope_index` computes them, a step's rows past the prompt at index + delta
(as one row of positions where no row of the step is inside a prompt's layout),
and the per-token rotary rows as transformers' rotary embedding recomposes its sections."""

from __future__ import annotations

import types

import torch

from engine.models.rotary import cos_sin_cache
from engine.multimodal.mrope import mrope_cos_sin, prompt_positions, step_positions
from engine.multimodal.processor import ImageItem, MultiModalPrompt

IMAGE = 7


def _prompt():
    """Text, an image of 2 x 3 merged patches, text, an image of 4 x 1, text (grids in patches)."""
    grids = [torch.tensor([[1, 4, 6]]), torch.tensor([[1, 8, 2]])]
    ids = [1, 2, 3] + [IMAGE] * 6 + [4, 5] + [IMAGE] * 4 + [6, 6, 6]
    items = [ImageItem(b"a", 6, {"image_grid_thw": grids[0]}, 3), ImageItem(b"b", 4, {"image_grid_thw": grids[1]}, 11)]
    return ids, items, torch.cat(grids)


def test_prompt_positions_match_get_rope_index():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    ids, items, grids = _prompt()
    config = types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=2, tokens_per_second=2))
    model = types.SimpleNamespace(config=config)
    model.get_vision_position_ids = types.MethodType(Qwen2_5_VLModel.get_vision_position_ids, model)
    input_ids = torch.tensor([ids])
    expected, delta = Qwen2_5_VLModel.get_rope_index(
        model, input_ids, mm_token_type_ids=(input_ids == IMAGE).int(), image_grid_thw=grids
    )
    positions, ours = prompt_positions(len(ids), items, merge_size=2)
    assert torch.equal(positions, expected[:, 0]) and ours == int(delta) < 0


def test_step_rows_continue_at_the_delta():
    ids, items, _ = _prompt()
    prompt = MultiModalPrompt(items)
    prompt.extra["mrope"] = prompt_positions(len(ids), items, merge_size=2)
    positions, delta = prompt.extra["mrope"]
    seq = types.SimpleNamespace(mm=prompt, num_computed_tokens=10)
    text_only = types.SimpleNamespace(mm=None, num_computed_tokens=4)
    rows = step_positions([seq, text_only], [len(ids) + 2 - 10, 2], "cpu")
    assert torch.equal(rows[:, : len(ids) - 10], positions[:, 10:])
    assert rows[:, len(ids) - 10 : -2].tolist() == [[len(ids) + delta, len(ids) + 1 + delta]] * 3
    assert rows[:, -2:].tolist() == [[4, 5]] * 3
    assert step_positions([text_only], [2], "cpu") is None
    seq.num_computed_tokens = len(ids) + 3  # decoding: every row past its prompt, one position for all axes
    assert step_positions([seq, text_only], [1, 1], "cpu").tolist() == [len(ids) + 3 + delta, 4]
    # a recompute after preemption: chunks of several tokens, all past their prompts, in one batch
    rows = step_positions([text_only, seq, text_only], [2, 3, 1], "cpu").tolist()
    assert rows == [4, 5, *range(len(ids) + 3 + delta, len(ids) + 6 + delta), 4]


def test_cos_sin_rows_follow_the_sections():
    table = cos_sin_cache(16, 64, 10000.0, None)
    positions = torch.tensor([[3, 5], [7, 5], [9, 5]])
    rows = mrope_cos_sin(table, positions, (2, 3, 3))
    axis = [0, 0, 1, 1, 1, 2, 2, 2] * 2
    for t in range(2):
        assert torch.equal(rows[t], torch.stack([table[positions[a, t], j] for j, a in enumerate(axis)]))
    assert torch.equal(rows[1], table[5])  # equal axes: plain RoPE
