"""A prompt's images through the model directory's own image processor (transformers' PIL
implementation: torchvision is never needed), and its placeholders expanded as the family's
transformers processor expands them: each image marker in the text becomes that image's run of image
tokens (in the token ids where a run is the marker's added token repeated: `tokenize`), then each run is
located in the token ids."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.multimodal import qwen_pixels
from engine.multimodal.families import WHOLE_IMAGE_FAMILIES, multimodal_family
from engine.multimodal.images import ImageError, image_hash
from engine.multimodal.mrope import prompt_positions

RECENT_IMAGES = 64  # processor outputs kept by image hash (a job's repeated pictures)


@dataclass
class ImageItem:
    hash: bytes
    length: int  # placeholder tokens in the prompt
    # the encoder's inputs for this image (pixel_values, and image_grid_thw for Qwen2.5-VL); None until
    # `fill_pixels` makes them where the placeholder count is known from the image's size (Qwen2.5-VL)
    pixels: dict | None
    offset: int = -1  # the first placeholder's position in the prompt, once located
    grid: tuple[int, int, int] | None = None  # Qwen2.5-VL's patch grid (t, h, w), from the image's size
    source: tuple | None = None  # (its ImagePromptProcessor, the image) while `pixels` is None


@dataclass
class MultiModalPrompt:
    images: list[ImageItem]
    salt: bytes = b""  # the images' hashes together: the prefix cache's root, so other images share no KV
    whole_images: bool = False  # a prefill chunk may not end inside an image (Gemma 3's bidirectional images)
    end: int = field(init=False)  # the position after the last image's placeholders: no image rows past it
    extra: dict = field(default_factory=dict)  # family data (Qwen2.5-VL's M-RoPE positions)

    def __post_init__(self):  # the images are located (their offsets set) before the prompt is made
        self.end = max((item.offset + item.length for item in self.images), default=0)

    def overlapping(self, start: int, end: int):
        """(image, first index inside the image, first prompt position, count) for the images whose
        placeholder run meets positions [start, end)."""
        for item in self.images:
            lo, hi = max(start, item.offset), min(end, item.offset + item.length)
            if lo < hi:
                yield item, lo - item.offset, lo, hi - lo


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


class ImagePromptProcessor:
    def __init__(self, model_path: Path, raw_config: dict, tokenizer):
        self.family = multimodal_family(raw_config)
        self.config = raw_config
        self.tokenizer = tokenizer
        settings = {
            **_read_json(model_path / "preprocessor_config.json"),
            **_read_json(model_path / "processor_config.json"),
        }
        settings.pop("image_processor", None)
        self.settings = settings
        self._recent: dict[bytes, dict] = {}
        self._recent_lock = threading.Lock()  # a worker's shard threads prepare requests at once
        self.image_processor = _load_image_processor(model_path)
        vocab = tokenizer.get_vocab()
        if self.family == "llava":
            self.marker = settings.get("image_token", "<image>")
            self.image_token = self.marker
        elif self.family == "gemma3":
            self.marker = getattr(tokenizer, "boi_token", None) or "<start_of_image>"
            self.image_token = getattr(tokenizer, "image_token", None) or "<image_soft_token>"
            self.eoi = getattr(tokenizer, "eoi_token", None) or "<end_of_image>"
        else:
            self.marker = self.image_token = "<|image_pad|>"
        if self.image_token not in vocab:
            raise ValueError(f"the tokenizer has no image token {self.image_token!r}")
        self.image_token_id = vocab[self.image_token]

    def preprocess(self, images: list) -> list[ImageItem]:
        """Each image's processor outputs and placeholder count (the last few images' kept by hash). Qwen2.5-VL's
        count follows from the image's size (its processor's resize rule): its pixels are made later, for a
        step's new images together, and never for an image whose embeddings the encoder cache holds."""
        items = []
        for image in images:
            key = image_hash(image)
            pixels = self._recent.get(key)
            if self.family == "qwen2_5_vl":
                grid = self._grid(image)
                length = grid[0] * grid[1] * grid[2] // self.image_processor.merge_size**2
                items.append(ImageItem(key, length, pixels, grid=grid, source=None if pixels else (self, image)))
                continue
            if pixels is None:
                pixels = dict(self.image_processor(images=[image], return_tensors="pt"))
                self._remember(key, pixels)
            items.append(ImageItem(key, self._num_tokens(pixels), pixels))
        return items

    def _remember(self, key: bytes, pixels: dict) -> None:
        with self._recent_lock:
            self._recent[key] = pixels
            while len(self._recent) > RECENT_IMAGES:
                self._recent.pop(next(iter(self._recent)))

    def _grid(self, image) -> tuple[int, int, int]:
        """Qwen2.5-VL's patch grid of `image`, as its image processor resizes and patches it."""
        width, height = qwen_pixels.resized_size(self.image_processor, image)
        patch = self.image_processor.patch_size
        return (1, height // patch, width // patch)

    def _fill(self, items: list[ImageItem]) -> None:
        """The pixels of `items` (Qwen2.5-VL, prepared without them) in one processor call."""
        unique = list({item.hash: item for item in items}.values())
        images = [item.source[1] for item in unique]
        out = qwen_pixels.pixels(self.image_processor, images)
        if out is None:
            out = self.image_processor(images=images, return_tensors="pt")
        grids = out["image_grid_thw"]
        rows = torch.split(out["pixel_values"], grids.prod(-1).tolist())
        made = {}
        for i, (item, patches) in enumerate(zip(unique, rows)):
            if tuple(grids[i].tolist()) != item.grid:
                raise RuntimeError(f"the image processor made a {tuple(grids[i].tolist())} grid, not {item.grid}")
            made[item.hash] = {"pixel_values": patches, "image_grid_thw": grids[i : i + 1]}
            self._remember(item.hash, made[item.hash])
        for item in items:
            item.pixels, item.source = made[item.hash], None

    def expand_tokens(self, token_ids: list[int], items: list[ImageItem]) -> list[int]:
        """Token ids whose image placeholders are already expanded, as they are; else each single
        image token becomes its image's run (vLLM's token prompts)."""
        count = token_ids.count(self.image_token_id)
        if count == sum(item.length for item in items) or count != len(items):
            return token_ids
        out, images = [], iter(items)
        for token in token_ids:
            out += [token] * next(images).length if token == self.image_token_id else [token]
        return out

    def _num_tokens(self, pixels: dict) -> int:
        """LLaVA's and Gemma 3's placeholder count (Qwen2.5-VL's comes from its grid: `preprocess`)."""
        if self.family == "llava":
            height, width = pixels["pixel_values"].shape[-2:]
            patch = self.settings.get("patch_size") or self.config["vision_config"]["patch_size"]
            strategy = self.settings.get(
                "vision_feature_select_strategy", self.config.get("vision_feature_select_strategy", "default")
            )
            extra = self.settings.get("num_additional_image_tokens", 0)
            return (height // patch) * (width // patch) + extra - (strategy == "default")
        return self.config.get("mm_tokens_per_image", 256)  # Gemma 3

    def tokenize(self, tokenizer, text: str, items: list[ImageItem], add_special_tokens: bool) -> list[int]:
        """The token ids of `text` with its image markers expanded, as `tokenizer(self.expand(text, items))`
        gives them. Where an image's run is its marker's token repeated (LLaVA, Qwen2.5-VL) and that token
        is an added token (which the tokenizer splits out before anything else, so its neighbours
        tokenize alike however many there are), the text is tokenized with one marker per image and each
        marker's id repeated: tokenizing runs of hundreds of placeholders was most of a request's preparation."""
        if self.family == "gemma3" or self.marker not in _added_tokens(tokenizer):
            return tokenizer(self.expand(text, items), add_special_tokens=add_special_tokens).input_ids
        markers = text.count(self.marker)
        if markers != len(items):
            self.expand(text, items)  # raises its mismatch error
        ids = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        if ids.count(self.image_token_id) != len(items):  # a marker glued into another added token
            return tokenizer(self.expand(text, items), add_special_tokens=add_special_tokens).input_ids
        out, at = [], 0
        for item in items:
            found = ids.index(self.image_token_id, at)
            out += ids[at:found]
            out += [self.image_token_id] * item.length
            at = found + 1
        return out + ids[at:]

    def expand(self, text: str, items: list[ImageItem]) -> str:
        """The prompt text with each image marker replaced as the transformers processor does."""
        pieces = text.split(self.marker)
        if len(pieces) - 1 != len(items):
            raise ImageError(
                "image_placeholder_mismatch",
                f"the prompt has {len(pieces) - 1} image placeholders ({self.marker!r}) but {len(items)} images",
            )
        out = [pieces[0]]
        for item, piece in zip(items, pieces[1:]):
            out += [self._replacement(item), piece]
        return "".join(out)

    def _replacement(self, item: ImageItem) -> str:
        run = self.image_token * item.length
        if self.family == "gemma3":
            return f"\n\n{self.marker}{run}{self.eoi}\n\n"
        return run

    def locate(self, token_ids: list[int], items: list[ImageItem]) -> MultiModalPrompt:
        """Each image's placeholder run in the tokenized prompt, in order."""
        image, needed = self.image_token_id, sum(item.length for item in items)
        found = token_ids.count(image)
        if found != needed:
            raise ImageError(
                "image_placeholder_mismatch",
                f"the prompt holds {found} image tokens; its images need {needed}",
            )
        at = 0
        for item in items:
            item.offset = token_ids.index(image, at)
            at = item.offset + item.length
            if token_ids[item.offset : at] != [image] * item.length:
                raise ImageError("image_placeholder_mismatch", "an image's placeholder tokens are not contiguous")
        salt = hashlib.sha256(b"".join(item.hash for item in items)).digest() if items else b""
        prompt = MultiModalPrompt(items, salt, self.family in WHOLE_IMAGE_FAMILIES)
        if self.family == "qwen2_5_vl" and items:
            prompt.extra["mrope"] = prompt_positions(len(token_ids), items, self.image_processor.merge_size)
        return prompt


def fill_pixels(items: list[ImageItem]) -> None:
    """Make the pixels of the items prepared without them: one processor call for all of a processor's."""
    groups: dict[int, tuple] = {}
    for item in items:
        if item.pixels is None:
            groups.setdefault(id(item.source[0]), (item.source[0], []))[1].append(item)
    for processor, group in groups.values():
        processor._fill(group)


def _added_tokens(tokenizer) -> set[str]:
    """The tokenizer's added tokens' texts (cached on it: the set does not change)."""
    added = getattr(tokenizer, "_pagedbatch_added_tokens", None)
    if added is None:
        added = {token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values()}
        tokenizer._pagedbatch_added_tokens = added
    return added


def _load_image_processor(path: Path):
    """The directory's image processor (preprocessor_config.json, or transformers 5's processor_config.json
    "image_processor" entry), in its PIL implementation: no torchvision."""
    import transformers

    settings = _read_json(path / "processor_config.json").get("image_processor") or _read_json(
        path / "preprocessor_config.json"
    )
    name = settings.get("image_processor_type", "")
    base = name.removesuffix("Fast").removesuffix("Pil")
    cls = getattr(transformers, base + "Pil", None) or getattr(transformers, base, None)
    if cls is None:
        raise ValueError(f"unknown image processor {name!r} in {path}")
    return cls.from_dict({k: v for k, v in settings.items() if k != "image_processor_type"})
