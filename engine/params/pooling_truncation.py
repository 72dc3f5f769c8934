"""Cutting an embedding input to `truncate_prompt_tokens` (torch-free: the batch validator cuts a
line's inputs with it too, so a line runs what `LLM.embed` would).

A text is cut as its tokenizer cuts it, as sentence-transformers (to its `max_seq_length`) and
vLLM's pooling runner do: the content is cut and the special tokens the tokenizer adds (a BOS,
the closing EOS that Qwen3-Embedding's last-token pooling reads) are kept. `side` "right" keeps
the first tokens (their default), "left" the last. Token ids given as such are cut as they are."""

from __future__ import annotations

SIDES = ("right", "left")


def kept_tokens(keep: int | None, max_model_len: int) -> int | None:
    """How many tokens `truncate_prompt_tokens` keeps (-1: the context; None: no cut)."""
    if keep is None:
        return None
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens={keep} exceeds the model's context of {max_model_len}")
    return max_model_len if keep == -1 else keep


def cut(ids: list[int], keep: int | None, side: str = "right", plain: list[int] | None = None) -> list[int]:
    """`ids` cut to `keep` tokens. `plain`: the same text tokenized without special tokens
    (None for token ids given as such): then only the content is cut."""
    if keep is None or len(ids) <= keep:
        return ids
    start = None if plain is None else _content_start(ids, plain)
    if start is None:
        return ids[:keep] if side == "right" else ids[-keep:]
    specials = len(ids) - len(plain)
    room = keep - specials
    if room < 1:
        raise ValueError(
            f"truncate_prompt_tokens={keep} leaves no room for the text beside the tokenizer's "
            f"{specials} special tokens"
        )
    content = plain[:room] if side == "right" else plain[-room:]
    return ids[:start] + content + ids[start + len(plain) :]


def _content_start(ids: list[int], plain: list[int]) -> int | None:
    """Where the plain tokenization sits inside the one with special tokens (None: it does not)."""
    for start in range(len(ids) - len(plain) + 1):
        if ids[start : start + len(plain)] == plain:
            return start
    return None
