"""Tokenizer loading, prompt encoding, and incremental detokenization."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from engine.core.sequence import Sequence
from engine.hf.chat_template import render_chat

# Decoding starts a few tokens back so that tokenizers whose text depends on the
# previous token (leading spaces, multi-byte characters) come out right.
_CONTEXT_TOKENS = 5


@cache
def load_tokenizer(path: str | Path, mode: str = "auto", revision: str | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), use_fast=mode != "slow", revision=revision)


def decoding_tokenizer(path: str | Path, mode: str = "auto", revision: str | None = None):
    """The tokenizer that decoding and the EOS id need: a directory's `tokenizer.json` through `tokenizers`
    (`engine.hf.light_tokenizer`, milliseconds) where it is read faithfully without transformers, else
    transformers' own (importing transformers alone takes about a second)."""
    if mode != "slow" and revision is None and Path(path).is_dir():
        from engine.hf import light_tokenizer

        light = light_tokenizer.load(path)
        if light is not None:
            return light
    return load_tokenizer(path, mode, revision)


def eos_token_id(tokenizer) -> int | None:
    if hasattr(tokenizer, "eos_token_id"):
        return tokenizer.eos_token_id
    eos = tokenizer.special_tokens_map.get("eos_token")
    return None if eos is None else tokenizer.convert_tokens_to_ids(eos)


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

    def decode_new_text(self, seq: Sequence, end: int | None = None) -> str:
        """Append the text of the seq's tokens not yet decoded (those before `end`, default all) to
        `seq.output_text`; return the new part. One call may cover one new token or a whole chunk:
        the text comes out the same.

        Text is held back while the latest bytes form an incomplete character.
        """
        if seq.detok_offsets is None:
            seq.detok_offsets = (max(seq.num_prompt_tokens - _CONTEXT_TOKENS, 0), seq.num_prompt_tokens)
        prefix_offset, read_offset = seq.detok_offsets
        end = len(seq.token_ids) if end is None else end
        if read_offset >= end:
            return ""
        skip = seq.params.skip_special_tokens
        before = self.decode(seq.token_ids[prefix_offset:read_offset], skip_special_tokens=skip)
        after = self.decode(seq.token_ids[prefix_offset:end], skip_special_tokens=skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new_text = after[len(before) :]
        seq.detok_offsets = (read_offset, end)
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
