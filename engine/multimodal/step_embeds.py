"""The image half of a step: which placeholder positions of the step's chunks are images, their
embeddings (from the cache, or the vision encoder run batched over the step's uncached images, in
groups of at most `encoder_batch_tokens` tokens), spliced by position so that a chunk may start or
end inside an image."""

from __future__ import annotations

import torch

from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.processor import fill_pixels


class StepEmbeds:
    def __init__(self, encoder, device: torch.device, dtype: torch.dtype, cache_tokens: int, encoder_batch_tokens: int):
        self.encoder = encoder
        self.device = device
        self.dtype = dtype
        self.cache = EncoderCache(cache_tokens)
        self.encoder_batch_tokens = encoder_batch_tokens
        self.images_encoded = 0
        self.encoder_calls = 0
        self.bidirectional = encoder.family == "gemma3"  # image tokens attend both ways within an image

    @torch.no_grad()
    def for_batch(self, seqs, num_new_tokens) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat rows of the step's tokens that are image placeholders, their embeddings), or None."""
        spans, offset = [], 0
        for seq, n in zip(seqs, num_new_tokens):
            mm = seq.mm
            if mm is not None and seq.num_computed_tokens < mm.end:  # decodes are past every image
                start = seq.num_computed_tokens
                for item, first, pos, count in mm.overlapping(start, start + n):
                    spans.append((offset + pos - start, item, first, count))
            offset += n
        if not spans:
            return None
        needed = {item.hash: item for _, item, _, _ in spans}
        self._encode([item for key, item in needed.items() if self.cache.get(key) is None], set(needed))
        rows = torch.cat([torch.arange(row, row + count) for row, _, _, count in spans])
        embeds = torch.cat([self.cache.entries[item.hash][first : first + count] for _, item, first, count in spans])
        return rows.to(self.device), embeds

    def _encode(self, items, pinned) -> None:
        """Encode `items` in batches of same-shaped inputs under the encoder's token budget."""
        fill_pixels(items)  # the step's new Qwen2.5-VL images through their processor at once
        groups: dict[tuple, list] = {}
        for item in items:
            groups.setdefault(self._shape_key(item), []).append(item)
        for group in groups.values():
            batch, tokens = [], 0
            for item in group:
                if batch and tokens + item.length > self.encoder_batch_tokens:
                    self._run(batch, pinned)
                    batch, tokens = [], 0
                batch.append(item)
                tokens += item.length
            if batch:
                self._run(batch, pinned)

    def _shape_key(self, item) -> tuple:
        if "image_grid_thw" in item.pixels:  # Qwen2.5-VL: patches of any count concatenate
            return ("patches",)
        return tuple(item.pixels["pixel_values"].shape[1:])

    def _run(self, batch, pinned) -> None:
        pixels = {
            k: torch.cat([item.pixels[k] for item in batch]).to(self.device)
            for k in batch[0].pixels
            if isinstance(batch[0].pixels[k], torch.Tensor)
        }
        pixels["pixel_values"] = pixels["pixel_values"].to(self.dtype)
        outputs = self.encoder(pixels)
        self.encoder_calls += 1
        for item, out in zip(batch, outputs):
            if out.shape[0] != item.length:
                raise RuntimeError(
                    f"the vision encoder gave {out.shape[0]} embeddings for {item.length} placeholder tokens"
                )
            self.images_encoded += 1
            self.cache.put(item.hash, out.to(self.dtype), pinned)
