"""A request's images: vLLM's `multi_modal_data` ({"image": image or [images]}) and OpenAI chat content
parts (`image_url` with data: or http(s) URLs, `image_pil`, `input_image`), counted against
`limit_mm_per_prompt`; chat messages come back in the shape Hugging Face chat templates render
({"type": "image"} parts in place of each picture). Torch-free."""

from __future__ import annotations

from collections.abc import Mapping

from engine.multimodal.images import ImageError, ImageLimits, load_image

IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil", "image")


def check_count(count: int, limit_mm_per_prompt: Mapping | None) -> None:
    limit = (limit_mm_per_prompt or {}).get("image")
    if limit is None:
        return
    if isinstance(limit, Mapping):  # vLLM's newer {"image": {"count": n, ...}}
        limit = limit.get("count")
    if limit is not None and count > int(limit):
        raise ImageError(
            "too_many_images",
            f"the prompt has {count} images; at most {limit} are allowed per prompt (limit_mm_per_prompt)",
        )


def images_of(
    multi_modal_data, limit_mm_per_prompt: Mapping | None = None, limits: ImageLimits | None = None, fetch=None
) -> list:
    """The PIL images of a prompt's `multi_modal_data`."""
    if not isinstance(multi_modal_data, Mapping):
        raise ValueError("multi_modal_data must be a dict such as {'image': image or [images]}")
    unknown = sorted(set(multi_modal_data) - {"image"})
    if unknown:
        raise ValueError(f"multi_modal_data: only 'image' is supported, got {unknown}")
    items = multi_modal_data.get("image")
    items = [] if items is None else items if isinstance(items, list | tuple) else [items]
    check_count(len(items), limit_mm_per_prompt)
    return [load_image(item, limits, fetch) for item in items]


def part_image_source(part: Mapping):
    """What an image content part points at: a URL string, or a PIL image (`image_pil`)."""
    kind = part.get("type")
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, Mapping) else value
    elif kind == "input_image":  # the Responses API's part
        url = part.get("image_url")
    else:
        url = part.get(kind)
    if url is None:
        raise ImageError("invalid_image_url", f"a {kind!r} part needs its image")
    return url


def chat_messages(
    conversation: list, limit_mm_per_prompt: Mapping | None = None, limits: ImageLimits | None = None, fetch=None
) -> tuple[list[dict], list]:
    """(messages for the chat template, the conversation's images in order)."""
    messages, sources = [], []
    for message in conversation:
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError("each chat message must be a dict with a 'role'")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind in ("text", "input_text") and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in IMAGE_PART_TYPES:
                    sources.append(part_image_source(part))
                    parts.append({"type": "image"})
                else:
                    raise ValueError(f"unsupported content part {kind or type(part).__name__!r}")
            content = parts
        messages.append({**message, "content": content})
    check_count(len(sources), limit_mm_per_prompt)
    return messages, [load_image(s, limits, fetch) for s in sources]


def has_images(conversation) -> bool:
    return any(
        isinstance(m, Mapping)
        and isinstance(m.get("content"), list)
        and any(isinstance(p, Mapping) and p.get("type") in IMAGE_PART_TYPES for p in m["content"])
        for m in conversation
    )
