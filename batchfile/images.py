"""Image content parts of batch lines (`image_url` in chat messages, `input_image` in /v1/responses
input), checked at upload where that needs no network: data URLs decoded within the byte and pixel
limits, http(s) URLs well formed and not pointing at a forbidden address literal (the worker fetches
them, behind the same guard, and resolves names there), `detail` one of OpenAI's values, and the count
per line. Errors carry their own codes (invalid_image, image_too_large, invalid_image_url,
url_forbidden, too_many_images, model_not_multimodal)."""

from __future__ import annotations

import ipaddress
import urllib.parse

from batchfile.errors import InvalidLine
from engine.multimodal.images import ImageError, ImageLimits, decode_data_url, decode_image
from engine.multimodal.request import part_image_source
from engine.multimodal.url_guard import check_address, env_allowed_networks
from settings import EngineSettings, value

DETAILS = ("auto", "low", "high")
MAX_IMAGES_PER_LINE = value(EngineSettings, "max_images_per_line")


def image_part(where: str, part: dict) -> dict:
    """The checked part as the chat template sees it: {"type": "image", "source": its URL}."""
    try:
        source = part_image_source(part)
        detail = (part.get("image_url") if isinstance(part.get("image_url"), dict) else part).get("detail")
        if detail is not None and detail not in DETAILS:
            raise ImageError("invalid_image_url", f"detail must be one of {', '.join(DETAILS)}")
        if not isinstance(source, str):
            raise ImageError("invalid_image_url", "the image URL must be a string")
        check_source(source)
    except ImageError as exc:
        raise InvalidLine(exc.code, f"{where}: {exc}") from None
    return {"type": "image", "source": source}


def check_source(url: str, limits: ImageLimits | None = None) -> None:
    if url.startswith("data:"):
        decode_image(decode_data_url(url, limits), limits)
        return
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ImageError("invalid_image_url", "an image URL must be a data: URL or an http(s) URL with a host")
    try:
        literal = ipaddress.ip_address(parts.hostname)
    except ValueError:
        return  # a name: resolved and checked by the worker when it fetches
    check_address(str(literal), env_allowed_networks())


def check_count(count: int) -> None:
    if count > MAX_IMAGES_PER_LINE:
        raise InvalidLine("too_many_images", f"the line has {count} images; at most {MAX_IMAGES_PER_LINE} are allowed")


def images_in(messages: list[dict]) -> list[str]:
    return [
        p["source"]
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p.get("type") == "image"
    ]
