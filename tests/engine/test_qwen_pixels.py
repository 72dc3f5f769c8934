"""Qwen2.5-VL's pixel patches (engine/multimodal/qwen_pixels) equal transformers' PIL image processor's,
bit for bit, on pictures that are upscaled, downscaled and kept, with the tiny model's settings and a
real checkpoint's (patch 14), and with rescaling or normalizing switched off; settings or pictures it
does not mirror are left to the processor."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2VLImageProcessorPil

from engine.multimodal import qwen_pixels
from engine.multimodal.processor import _load_image_processor
from tests.vision_helpers import picture

# (width, height): tiny, odd, very wide and very tall, already whole patches, larger than the pixel bound
SIZES = [(24, 24), (33, 17), (200, 50), (7, 300), (56, 56), (640, 480), (1111, 333)]


def real_processor(**overrides) -> Qwen2VLImageProcessorPil:
    """Qwen2.5-VL-7B-Instruct's preprocessor_config.json (max_pixels lowered to keep the test small)."""
    settings = dict(
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 3136, "longest_edge": 200_704},
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
        resample=3,
    )
    return Qwen2VLImageProcessorPil(**{**settings, **overrides})


def assert_same(processor, images) -> None:
    ours = qwen_pixels.pixels(processor, images)
    theirs = processor(images=images, return_tensors="pt")
    assert ours is not None
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert ours["pixel_values"].dtype == theirs["pixel_values"].dtype == torch.float32
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])


def test_the_tiny_models_patches_equal_transformers(tiny_model):
    processor = _load_image_processor(tiny_model("qwen2.5-vl"))
    assert_same(processor, [picture(seed, w, h) for seed, (w, h) in enumerate(SIZES)])


@pytest.mark.parametrize(
    "overrides",
    [{}, {"do_rescale": False}, {"do_normalize": False}, {"rescale_factor": 1 / 127.5, "image_mean": [0.5] * 3}],
    ids=["checkpoint", "no-rescale", "no-normalize", "other-constants"],
)
def test_a_real_checkpoints_patches_equal_transformers(overrides):
    processor = real_processor(**overrides)
    images = [picture(10 + seed, w, h) for seed, (w, h) in enumerate(SIZES)]
    assert_same(processor, images)
    assert_same(processor, images[:1])  # one picture alone gives the same rows as among others


def test_unmirrored_pictures_and_settings_go_to_the_processor(tiny_model):
    processor = _load_image_processor(tiny_model("qwen2.5-vl"))
    assert qwen_pixels.pixels(processor, [picture(1).convert("RGBA")]) is None  # RGB conversion is the processor's
    unresized = real_processor(do_resize=False)
    assert qwen_pixels.pixels(unresized, [picture(1, 30, 30)]) is None  # not whole patches: the processor's error
    assert qwen_pixels.pixels(unresized, [picture(1, 56, 28)]) is not None
    assert_same(unresized, [picture(1, 56, 28)])


def test_the_table_follows_a_changed_setting():
    processor = real_processor()
    first = qwen_pixels.pixels(processor, [picture(3)])["pixel_values"]
    processor.image_std = [0.5, 0.5, 0.5]
    assert_same(processor, [picture(3)])
    assert not torch.equal(first, qwen_pixels.pixels(processor, [picture(3)])["pixel_values"])


def test_many_large_pictures_are_resized_on_threads_with_the_same_patches(monkeypatch):
    monkeypatch.setattr(qwen_pixels, "PARALLEL_PIXELS", 100_000)
    monkeypatch.setattr(qwen_pixels, "_resize_pool", None)
    images = [picture(20 + seed, w, h) for seed, (w, h) in enumerate(SIZES)]
    assert_same(real_processor(), images)
    assert qwen_pixels._resize_pool is not None  # the threads ran
    monkeypatch.setattr(qwen_pixels, "_resize_pool", None)
    assert_same(real_processor(), images[:1])
    assert qwen_pixels._resize_pool is None  # one picture: resized where it is
