"""A request's prompt with images for the engine: the images loaded (data URLs decoded, http(s) URLs
fetched behind the address guard) and counted against `limit_mm_per_prompt`, preprocessed, the
placeholders expanded and located; text prompts go on to the engine's own `prepare`."""

from __future__ import annotations

import functools

from engine.core.request_checks import truncate_prompt
from engine.multimodal.images import ImageError
from engine.multimodal.request import images_of
from engine.multimodal.setup import make_prompt_processor
from engine.multimodal.url_guard import FetchLimits, env_allowed_networks, fetch_url


def prompt_processor(engine):
    """The engine's ImagePromptProcessor (made on first use), or None for a text-only model."""
    if not hasattr(engine, "_image_prompts"):
        engine._image_prompts = make_prompt_processor(engine.model_config, engine.tokenizer)
    return engine._image_prompts


def fetcher(engine):
    allowed = tuple(engine.config.image_fetch_allowed_networks) + env_allowed_networks()
    limits = FetchLimits(allowed_networks=allowed)
    return functools.partial(fetch_url, limits=limits)


def prepare_request(engine, prompt, params):
    """(text, token ids, MultiModalPrompt or None) of a prompt, checked against the model and `params`."""
    if not (isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None):
        return (*engine.prepare(prompt, params), None)
    processor = prompt_processor(engine)
    if processor is None:
        raise ValueError(f"{engine.model_config.path.name}: this model takes no images (multi_modal_data)")
    images = images_of(prompt["multi_modal_data"], engine.config.limit_mm_per_prompt, fetch=fetcher(engine))
    items = processor.preprocess(images)
    params.validate()
    if "prompt_token_ids" in prompt:
        text, ids = engine.tokenize({"prompt_token_ids": prompt["prompt_token_ids"]})
        ids, text = processor.expand_tokens(ids, items), prompt.get("prompt")
    else:
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError("a prompt with multi_modal_data needs its 'prompt' text (or 'prompt_token_ids')")
        special = prompt.get("add_special_tokens", True)  # False: a rendered chat (its template holds them)
        ids = processor.tokenize(engine.decoding_tokenizer, text, items, add_special_tokens=special)
    if truncate_prompt(ids, params.truncate_prompt_tokens, engine.max_model_len) != ids:
        raise ImageError("image_prompt_truncated", "a prompt with images cannot be truncated")
    engine.check_request(ids, params)
    images = processor.locate(ids, items)
    budget = engine.config.max_num_batched_tokens
    if images.whole_images and any(item.length > budget for item in items):
        raise ImageError(
            "image_too_large",
            f"an image of {max(i.length for i in items)} tokens does not fit "
            f"max_num_batched_tokens={budget} (its tokens are computed in one step)",
        )
    return text, ids, images
