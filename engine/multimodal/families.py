"""The image-text architectures whose vision path the engine runs (architecture -> family). Torch-free.
Gemma 3 and Mistral 3 wrappers not listed here still load as text models (their towers skipped)."""

MULTIMODAL_FAMILIES = {
    "LlavaForConditionalGeneration": "llava",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
WHOLE_IMAGE_FAMILIES = ("gemma3",)  # a prefill chunk never ends inside one of their images


def multimodal_family(raw_config: dict | None) -> str | None:
    archs = (raw_config or {}).get("architectures") or []
    return next((MULTIMODAL_FAMILIES[a] for a in archs if a in MULTIMODAL_FAMILIES), None)


def image_tokens(model_dir, raw_config: dict) -> int | None:
    """About how many prompt tokens one image adds (for the batch validator's context check; the worker
    counts exactly), or None when the model takes no images."""
    import json
    from pathlib import Path

    family = multimodal_family(raw_config)
    if family is None:
        return None
    if family == "gemma3":
        return raw_config.get("mm_tokens_per_image", 256) + 4  # with the begin/end markers and newlines
    path = Path(model_dir) / "processor_config.json"
    settings = json.loads(path.read_text()) if path.exists() else {}
    if family == "qwen2_5_vl":  # dynamic resolution: at most max_pixels, one token per merged patch square
        pre = Path(model_dir) / "preprocessor_config.json"
        images = settings.get("image_processor") or (json.loads(pre.read_text()) if pre.exists() else {})
        side = images.get("patch_size", 14) * images.get("merge_size", 2)
        most = images.get("max_pixels") or (images.get("size") or {}).get("longest_edge", 12845056)
        return most // side**2 + 2  # with the vision start and end tokens
    vision = raw_config.get("vision_config") or {}
    crop = (settings.get("image_processor") or {}).get("crop_size") or {}
    side = crop.get("height") or vision.get("image_size", 336)
    patch = settings.get("patch_size") or vision.get("patch_size", 14)
    extra = settings.get("num_additional_image_tokens", 0)
    return (side // patch) ** 2 + extra - (settings.get("vision_feature_select_strategy", "default") == "default")
