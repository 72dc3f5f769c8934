"""Tokenizer loading, prompt encoding, and incremental detokenization."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from engine.chat_template import render_chat
from engine.sequence import Sequence

# Decoding starts a few tokens back so that tokenizers whose text depends on the
# previous token (leading spaces, multi-byte characters) come out right.
_CONTEXT_TOKENS = 5


@cache
def load_tokenizer(path: str | Path, mode: str = "auto", revision: str | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), use_fast=mode != "slow", revision=revision)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    return tokenizer(prompt).input_ids


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    (text,) = render_chat(tokenizer, [messages])
    return tokenizer(text, add_special_tokens=False).input_ids


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # The Rust tokenizer decodes the same text without transformers' per-call Python
        # overhead, unless transformers post-processes it (clean_up_tokenization_spaces).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        fast = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._decode = backend.decode if fast else tokenizer.decode
        self._token_texts: dict[int, str] = {}  # at most one entry per vocabulary token

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (vLLM's `Logprob.decoded_token`)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._decode([token_id], skip_special_tokens=False)
        return text

    def decode_new_text(self, seq: Sequence) -> str:
        """Append the text of the seq's latest tokens to `seq.output_text`; return the new part.

        Text is held back while the latest bytes form an incomplete character.
        """
        if seq.detok_offsets is None:
            seq.detok_offsets = (max(seq.num_prompt_tokens - _CONTEXT_TOKENS, 0), seq.num_prompt_tokens)
        prefix_offset, read_offset = seq.detok_offsets
        skip = seq.params.skip_special_tokens
        before = self.decode(seq.token_ids[prefix_offset:read_offset], skip_special_tokens=skip)
        after = self.decode(seq.token_ids[prefix_offset:], skip_special_tokens=skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new_text = after[len(before) :]
        seq.detok_offsets = (read_offset, len(seq.token_ids))
        seq.output_text += new_text
        return new_text

    def flush(self, seq: Sequence, end: int | None = None) -> None:
        """At the end, emit whatever was held back (an incomplete character decodes as U+FFFD),
        from the tokens before `end` (default: all of them)."""
        if seq.detok_offsets is None:
            return
        end = len(seq.token_ids) if end is None else end
        prefix_offset, read_offset = seq.detok_offsets
        if read_offset < end:
            skip = seq.params.skip_special_tokens
            before = self.decode(seq.token_ids[prefix_offset:read_offset], skip_special_tokens=skip)
            after = self.decode(seq.token_ids[prefix_offset:end], skip_special_tokens=skip)
            seq.output_text += after[len(before) :]
            seq.detok_offsets = (read_offset, end)
