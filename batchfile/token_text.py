"""The text and bytes of generated tokens, for logprobs.

A token is not always text: byte-level BPE splits a character such as '°' into byte tokens that are
no UTF-8 on their own (decoding one alone gives U+FFFD). So each token gets:

- `bytes`: its real bytes, from the tokenizer's own vocabulary (byte-level pieces through the
  byte-to-unicode table, SentencePiece `<0xNN>` byte-fallback pieces, '▁' as a space);
- a `piece` of the content: what it added to the generated text. The pieces of a choice join into
  its text exactly: a byte token that does not finish a character adds "", the one that does adds
  the whole character; a special token the text skips adds "".

`tokenizer` is a Hugging Face tokenizer (anything with `decode` and `convert_ids_to_tokens`), or an
object holding one as `.tokenizer` (`batchfile.model_limits.ModelLimits`).
"""

from __future__ import annotations

import functools
import json
import re

_CONTEXT_TOKENS = 5  # decoding starts this many tokens back (leading spaces depend on the previous token)
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table (printable bytes map to themselves, the others
    to code points from 256 up), which every byte-level BPE vocabulary is written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@functools.lru_cache(maxsize=16)
def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, TypeError):
        return False
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    return "ByteLevel" in kinds


@functools.lru_cache(maxsize=16)
def _special_ids(tokenizer) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    ids.update(getattr(tokenizer, "added_tokens_decoder", None) or {})
    return frozenset(ids)


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer of a tokenizer or of a wrapper holding one (`ModelLimits`)."""
    return tokenizer if hasattr(tokenizer, "convert_ids_to_tokens") else tokenizer.tokenizer


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The token's real bytes (a special token's are its text's)."""
    tokenizer = hf_tokenizer(tokenizer)
    if token_id in _special_ids(tokenizer):
        return tokenizer.decode([token_id], skip_special_tokens=False).encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:
        return b""
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    if _is_byte_level(tokenizer):
        table = _unicode_to_byte()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
    return piece.replace("▁", " ").encode()


def token_label(tokenizer, token_id: int) -> str:
    """A token's own text where it is valid UTF-8, else its bytes written out ("bytes:\\xb0", as
    OpenAI writes a partial character)."""
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def text_pieces(tokenizer, token_ids: list[int], text: str, *, skip_special_tokens: bool = True) -> list[str]:
    """What each token added to `text` (the choice's generated text): the pieces join into `text`.

    Decoded incrementally like the engine's detokenizer (a few tokens of context, a character held
    back until its last byte arrives); cut to `text` where a stop string ended it early.
    """
    tokenizer = hf_tokenizer(tokenizer)
    pieces: list[str] = []
    prefix, read = 0, 0
    for i in range(len(token_ids)):
        before = tokenizer.decode(token_ids[prefix:read], skip_special_tokens=skip_special_tokens)
        after = tokenizer.decode(token_ids[prefix : i + 1], skip_special_tokens=skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            pieces.append("")  # nothing yet: an unfinished character, or a skipped special token
            continue
        pieces.append(after[len(before) :])
        prefix, read = max(i + 1 - _CONTEXT_TOKENS, 0), i + 1
    return _fit(pieces, text)


def _fit(pieces: list[str], text: str) -> list[str]:
    """Make the pieces join into `text` exactly: cut where the text ends (a stop string), and give a
    held-back tail (an unfinished character at the end) to the last token."""
    out, used = [], 0
    for piece in pieces:
        room = max(len(text) - used, 0)
        kept = piece if text.startswith(piece, used) else text[used : used + len(piece)]
        kept = kept[:room]
        out.append(kept)
        used += len(kept)
    if used < len(text) and out:
        out[-1] += text[used:]
    return out
