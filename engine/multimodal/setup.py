"""The engine's image path for a model: its vision encoder loaded from the checkpoint and the step hook
around it (None for a text-only model), and the prompt processor beside the tokenizer."""

from __future__ import annotations

from engine.multimodal.families import multimodal_family


def make_step_embeds(model_config, engine_config, device, dtype):
    family = multimodal_family(model_config.multimodal)
    if family is None:
        return None
    import torch

    from engine.hf.loader import checkpoint_files
    from engine.models.vision.towers import VisionEncoder
    from engine.multimodal.step_embeds import StepEmbeds

    with torch.device(device):
        encoder = VisionEncoder(family, model_config.multimodal)
    encoder.load(model_config.path, checkpoint_files(model_config.path))
    encoder = encoder.to(dtype=dtype).eval()
    return StepEmbeds(
        encoder, device, dtype, engine_config.mm_encoder_cache_tokens, engine_config.mm_encoder_batch_tokens
    )


def make_prompt_processor(model_config, tokenizer):
    if multimodal_family(model_config.multimodal) is None:
        return None
    from engine.multimodal.processor import ImagePromptProcessor

    return ImagePromptProcessor(model_config.path, model_config.multimodal, tokenizer)
