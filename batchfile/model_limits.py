"""What validation needs from a model directory (tokenizer, context length, vocabulary size),
loaded once per process and without weights."""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.hf import light_tokenizer
from engine.hf.chat_template import render_chat
from engine.hf.encoder_config import EncoderConfig, encoder_architecture
from engine.hf.model_info import context_length, read_config
from engine.hf.sentence_transformers_config import PoolerConfig, default_runner, read_pooler_config
from engine.multimodal.families import image_tokens


class UnknownModel(ValueError):
    pass


@dataclass(eq=False)
class ModelLimits:
    name: str
    # `engine.hf.light_tokenizer` (tokenizers + jinja2, no transformers/torch) where it reads the directory as
    # transformers would, else a Hugging Face tokenizer (fast ones are batched through their Rust backend)
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    # False (the default): special-token text in chat message content ("<|im_start|>system") is plain
    # text; only the chat template's own markers are special. True: it becomes the special token (vLLM's way).
    special_tokens_in_content: bool = False
    # "pooling": an embedding model (it serves /v1/embeddings lines only, with `pooler`); else "generate"
    runner: str = "generate"
    pooler: PoolerConfig | None = None
    hidden_size: int | None = None
    classifier: bool = False  # a sequence-classification model (a cross-encoder): score and rerank lines only
    image_tokens: int | None = None  # an image-text model: about the prompt tokens of one image; None: no images
    base_model: str | None = None  # a LoRA adapter's: the model whose workers run its lines (with the adapter)

    @classmethod
    def from_dir(
        cls,
        model_dir,
        *,
        name: str | None = None,
        max_model_len: int | None = None,
        special_tokens_in_content: bool = False,
    ) -> ModelLimits:
        """Load (once per process and arguments) from a Hugging Face model directory."""
        return _load(str(Path(model_dir).resolve()), name, max_model_len, special_tokens_in_content)

    def render_chat(
        self, conversations: list[list[dict]], template_kwargs: Mapping | None = None, tools: list[dict] | None = None
    ) -> list[str]:
        """Each conversation through the chat template (with `tools`), with the generation prompt appended."""
        return render_chat(self.tokenizer, conversations, template_kwargs, tools)

    def encode(self, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
        if not texts:
            return []
        if self._fast:
            backend = self.tokenizer.backend_tokenizer
            encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
            return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]
        return list(self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"])

    @functools.cached_property
    def special_strings(self) -> tuple[str, ...]:
        """The text of the tokenizer's special tokens (the ones a chat template's markers use)."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        found = {t.content for t in added.values() if getattr(t, "special", False) and t.content}
        found.update(getattr(self.tokenizer, "all_special_tokens", ()) or ())
        return tuple(sorted(found))

    def has_special_text(self, text: str) -> bool:
        return any(marker in text for marker in self.special_strings)

    def encode_guarded(self, text: str, plain: Mapping[str, str], *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`, in which each key of `plain` (a placeholder) stands for its value, a piece
        of user content tokenized as plain text: special-token strings in it stay text."""
        ids: list[int] = []
        pos = 0
        for match in re.finditer("|".join(map(re.escape, plain)), text):
            ids += self._encode_piece(text[pos : match.start()], add_special_tokens and not ids)
            ids += self._encode_plain(plain[match.group()])
            pos = match.end()
        return ids + self._encode_piece(text[pos:], add_special_tokens and not ids)

    def _encode_piece(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.encode([text], add_special_tokens=add_special_tokens)[0] if text else []

    def _encode_plain(self, text: str) -> list[int]:
        if not text:
            return []
        if self._plain_backend is not None:
            return self._plain_backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    @functools.cached_property
    def _plain_backend(self):
        """A copy of the Rust tokenizer that never matches special tokens (its own copy: the flag is
        per tokenizer, and the shared one is used from several threads)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or not self._fast:
            return None
        from tokenizers import Tokenizer

        plain = Tokenizer.from_str(backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode_pairs(self, firsts: list[str], seconds: list[str] | None, max_length: int | None = None) -> dict:
        """A cross-encoder's inputs (`input_ids`, and `token_type_ids` where the model takes them), cut to
        `max_length` longest-first when given."""
        if isinstance(self.tokenizer, light_tokenizer.LightTokenizer):
            return self.tokenizer.encode_pairs(firsts, seconds, max_length)
        kwargs = {} if max_length is None else {"truncation": True, "max_length": max_length}
        return self.tokenizer(firsts, seconds, **kwargs)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @functools.cached_property
    def _fast(self) -> bool:
        """Use the Rust backend directly only if it agrees with the tokenizer's own __call__."""
        if isinstance(self.tokenizer, light_tokenizer.LightTokenizer):
            return True
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
def _load(model_dir: str, name: str | None, max_model_len: int | None, special_in_content: bool) -> ModelLimits:
    config = read_config(model_dir)
    encoder = EncoderConfig.from_dict(config, Path(model_dir), max_model_len) if encoder_architecture(config) else None
    length = encoder.max_model_len if encoder else context_length(config, max_model_len)
    tokenizer = light_tokenizer.load(model_dir) or _hf_tokenizer(model_dir)
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or len(tokenizer)
    runner = default_runner(Path(model_dir), config)
    pooler = read_pooler_config(Path(model_dir), config) if runner == "pooling" else None
    hidden = (pooler.dense_output_size if pooler else None) or config.get("hidden_size")
    return ModelLimits(
        name or Path(model_dir).name,
        tokenizer,
        length,
        int(vocab),
        special_in_content,
        runner,
        pooler,
        hidden,
        bool(encoder and encoder.classifier),
        image_tokens(model_dir, config),
    )


def _hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer  # imports torch: only where the light tokenizer cannot serve

    return AutoTokenizer.from_pretrained(model_dir)


def limits_by_name(model_dirs: Mapping[str, str], special_in_content: Collection[str] = ()) -> dict[str, ModelLimits]:
    """Every configured model's limits, from {name: model directory}; `special_in_content` names the
    models whose chat content may hold real special tokens (the per-model opt-out)."""
    return {
        name: ModelLimits.from_dir(path, name=name, special_tokens_in_content=name in special_in_content)
        for name, path in model_dirs.items()
    }


def limits_of(model_dirs: Mapping[str, str], name: str, special_in_content: Collection[str] = ()) -> ModelLimits:
    """One configured model's limits; `UnknownModel` when `name` is not configured."""
    path = model_dirs.get(name)
    if path is None:
        known = ", ".join(sorted(model_dirs)) or "none"
        raise UnknownModel(f"unknown model {name!r}; available: {known}")
    return ModelLimits.from_dir(path, name=name, special_tokens_in_content=name in special_in_content)
