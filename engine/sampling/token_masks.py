"""Per-request logit edits that come before penalties, in vLLM's order: `allowed_token_ids`
(every other token masked), `bad_words` (the token that would complete a bad word masked),
`logit_bias` (added)."""

from __future__ import annotations

import torch

from engine.core.sequence import Sequence
from engine.runner.device import to_device


def bad_words_token_ids(tokenizer, bad_words: list[str]) -> list[list[int]]:
    """Each bad word's token ids, alone and after a space when that tokenizes to a
    different word of the same length (vLLM's rule, so words are caught mid-text too)."""
    result = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entry {word!r} tokenizes to nothing")
        result.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            result.append(spaced)
    return result


def _banned_by_bad_words(seq: Sequence) -> list[int]:
    output = seq.output_token_ids
    banned = []
    for ids in seq.bad_words_token_ids or ():
        prefix = ids[:-1]
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix):
            banned.append(ids[-1])
    return banned


def apply_token_masks(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    if not any(s.params.has_token_masks for s in seqs):
        return logits
    vocab = logits.shape[-1]
    ban_rows, ban_cols, bias_rows, bias_cols, bias_values, keep_rows, keep_cols = [], [], [], [], [], [], []
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.allowed_token_ids is not None:
            allowed = [t for t in p.allowed_token_ids if 0 <= t < vocab]
            keep_rows.extend([i] * len(allowed))
            keep_cols.extend(allowed)
        banned = [t for t in _banned_by_bad_words(seq) if 0 <= t < vocab]
        ban_rows.extend([i] * len(banned))
        ban_cols.extend(banned)
        for token, bias in (p.logit_bias or {}).items():
            if 0 <= token < vocab:
                bias_rows.append(i)
                bias_cols.append(token)
                bias_values.append(bias)
    device = logits.device
    if keep_rows:
        restricted = torch.zeros_like(logits, dtype=torch.bool)
        restricted[to_device(sorted(set(keep_rows)), torch.long, device)] = True
        keep = torch.zeros_like(restricted)
        keep[to_device(keep_rows, torch.long, device), to_device(keep_cols, torch.long, device)] = True
        logits = logits.masked_fill(restricted & ~keep, float("-inf"))
    if ban_rows:
        index = (to_device(ban_rows, torch.long, device), to_device(ban_cols, torch.long, device))
        logits = logits.index_put(index, logits.new_full((), float("-inf")))
    if bias_rows:
        index = (to_device(bias_rows, torch.long, device), to_device(bias_cols, torch.long, device))
        logits = logits.index_put(index, to_device(bias_values, torch.float32, device), accumulate=True)
    return logits
