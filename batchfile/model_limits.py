"""What validation needs from a model directory (tokenizer, context length, vocabulary size),
loaded once per process and without weights."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.chat_template import render_chat
from engine.model_info import context_length, read_config


class UnknownModel(ValueError):
    pass


@dataclass(eq=False)
class ModelLimits:
    name: str
    tokenizer: Any  # a Hugging Face tokenizer (fast ones are batched through their Rust backend)
    max_model_len: int
    vocab_size: int

    @classmethod
    def from_dir(cls, model_dir, *, name: str | None = None, max_model_len: int | None = None) -> ModelLimits:
        """Load (once per process and arguments) from a Hugging Face model directory."""
        return _load(str(Path(model_dir).resolve()), name, max_model_len)

    def render_chat(self, conversations: list[list[dict]], template_kwargs: Mapping | None = None) -> list[str]:
        """Each conversation through the chat template, with the generation prompt appended."""
        return render_chat(self.tokenizer, conversations, template_kwargs)

    def encode(self, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
        if not texts:
            return []
        if self._fast:
            backend = self.tokenizer.backend_tokenizer
            encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
            return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]
        return list(self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"])

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @functools.cached_property
    def _fast(self) -> bool:
        """Use the Rust backend directly only if it agrees with the tokenizer's own __call__."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if not getattr(self.tokenizer, "is_fast", False) or backend is None:
            return False
        probe = "Hello, world! <|im_start|> 12345  x\n\tÿ"
        try:
            mine = [e.ids for e in backend.encode_batch([probe], add_special_tokens=False)]
            return mine == [list(self.tokenizer(probe, add_special_tokens=False)["input_ids"])]
        except Exception:
            return False


@functools.lru_cache(maxsize=16)
def _load(model_dir: str, name: str | None, max_model_len: int | None) -> ModelLimits:
    from transformers import AutoTokenizer

    config = read_config(model_dir)
    length = context_length(config, max_model_len)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or len(tokenizer)
    return ModelLimits(name or Path(model_dir).name, tokenizer, length, int(vocab))


def limits_by_name(model_dirs: Mapping[str, str]) -> dict[str, ModelLimits]:
    """Every configured model's limits, from {name: model directory}."""
    return {name: ModelLimits.from_dir(path, name=name) for name, path in model_dirs.items()}


def limits_of(model_dirs: Mapping[str, str], name: str) -> ModelLimits:
    """One configured model's limits; `UnknownModel` when `name` is not configured."""
    path = model_dirs.get(name)
    if path is None:
        known = ", ".join(sorted(model_dirs)) or "none"
        raise UnknownModel(f"unknown model {name!r}; available: {known}")
    return ModelLimits.from_dir(path, name=name)
