"""Images from what a request may hold (a PIL image, bytes, a `data:` URL, an http(s) URL fetched
through `url_guard`), decoded with Pillow under byte and pixel limits, and an image's content hash
(the encoder cache's and the prefix cache's key). Torch-free: the batch validator uses it too."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass, field

from settings import EngineSettings, value


class ImageError(ValueError):
    """A bad image, with a stable error code for per-line errors."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ImageLimits:
    """Defaults from PAGEDBATCH_IMAGE_MAX_BYTES / PAGEDBATCH_IMAGE_MAX_PIXELS when set."""

    max_bytes: int = field(default_factory=lambda: value(EngineSettings, "image_max_bytes"))
    max_pixels: int = field(default_factory=lambda: value(EngineSettings, "image_max_pixels"))


def decode_data_url(url: str, limits: ImageLimits | None = None) -> bytes:
    """The bytes of a base64 `data:image/...;base64,` URL."""
    limits = limits or ImageLimits()
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise ImageError("invalid_image_url", "a data URL must look like data:image/<type>;base64,<data>")
    if not head[5:].startswith("image/"):
        raise ImageError("invalid_image_url", f"data URL media type {head[5:-7]!r} is not an image")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise ImageError("image_too_large", f"image is over the limit of {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("invalid_image", "data URL payload is not valid base64") from None


def decode_image(data: bytes, limits: ImageLimits | None = None):
    """A PIL image (RGB) from encoded bytes, refusing undecodable data and too many pixels."""
    from PIL import Image

    limits = limits or ImageLimits()
    if len(data) > limits.max_bytes:
        raise ImageError("image_too_large", f"image is {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        with Image.open(io.BytesIO(data)) as probe:  # the header alone: size before decoding
            width, height = probe.size
            if width * height > limits.max_pixels:
                raise ImageError(
                    "image_too_large", f"image is {width}x{height} pixels; the limit is {limits.max_pixels} pixels"
                )
            probe.load()
            return probe.convert("RGB")
    except ImageError:
        raise
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for bad data
        raise ImageError("invalid_image", f"image could not be decoded: {type(exc).__name__}") from None


def check_pil(image, limits: ImageLimits | None = None):
    """A PIL image given directly, in RGB, within the pixel limit."""
    limits = limits or ImageLimits()
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError("image_too_large", f"image is {width}x{height} pixels; the limit is {limits.max_pixels}")
    return image if image.mode == "RGB" else image.convert("RGB")


def load_image(source, limits: ImageLimits | None = None, fetch=None):
    """A PIL image from a PIL image, bytes, a data URL, or an http(s) URL (through `fetch(url) -> bytes`;
    without one, URLs are refused)."""
    if hasattr(source, "size") and hasattr(source, "convert"):
        return check_pil(source, limits)
    if isinstance(source, bytes | bytearray):
        return decode_image(bytes(source), limits)
    if isinstance(source, dict) and isinstance(source.get("url"), str):  # {"url": ...} as in image_url parts
        source = source["url"]
    if isinstance(source, str):
        if source.startswith("data:"):
            return decode_image(decode_data_url(source, limits), limits)
        if source.startswith(("http://", "https://")):
            if fetch is None:
                raise ImageError("url_forbidden", "http(s) image URLs are not fetched here")
            return decode_image(fetch(source), limits)
        raise ImageError("invalid_image_url", "an image URL must be a data: or http(s) URL")
    raise ImageError("invalid_image", f"an image must be a PIL image, bytes or a URL, got {type(source).__name__}")


def image_hash(image) -> bytes:
    """sha256 of the decoded pixels (mode and size included): the same picture, however it came."""
    digest = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.digest()
