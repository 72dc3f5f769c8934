"""Rendering chat prompts and tokenizing prompts for a chunk of validated lines, in batches
(one chat-template call per model and template arguments, one tokenizer call per tokenizer)."""

from __future__ import annotations

import json

from batchfile.errors import CHAT_TEMPLATE_ERROR, INVALID_PROMPT, LineError
from batchfile.validation import Pending


def render(chunk: list[Pending], errors: dict[int, LineError]) -> None:
    """Set `text` of the chunk's chat lines; a line whose template fails gets an error instead."""
    groups: dict[tuple, list[Pending]] = {}
    for p in chunk:
        if p.messages is not None:
            kwargs = json.dumps(p.template_kwargs, sort_keys=True) if p.template_kwargs else ""
            groups.setdefault((id(p.limits), kwargs), []).append(p)
    for group in groups.values():
        limits, kwargs = group[0].limits, group[0].template_kwargs
        try:
            texts = limits.render_chat([p.messages for p in group], kwargs)
        except Exception:
            texts = [_render_one(p, errors) for p in group]  # find the offending conversation(s)
        for p, text in zip(group, texts):
            p.text = text


def _render_one(p: Pending, errors: dict[int, LineError]) -> str | None:
    try:
        return p.limits.render_chat([p.messages], p.template_kwargs)[0]
    except Exception as e:
        message = f"the chat template failed: {str(e)[:300]}"
        errors[p.line] = LineError(p.line, p.custom_id, CHAT_TEMPLATE_ERROR, message)
        return None


def to_encode(chunk: list[Pending], errors: dict[int, LineError]) -> list[list[Pending]]:
    """The lines whose text is still to tokenize, grouped by tokenizer and add_special_tokens."""
    groups: dict[tuple, list[Pending]] = {}
    for p in chunk:
        if p.token_ids is None and p.text is not None and p.line not in errors:
            groups.setdefault((id(p.limits), p.add_special_tokens), []).append(p)
    return list(groups.values())


def encode(groups: list[list[Pending]], errors: dict[int, LineError]) -> None:
    """Tokenize the groups in batches (the fast tokenizer releases the GIL: this runs in a thread)."""
    for group in groups:
        limits, special = group[0].limits, group[0].add_special_tokens
        try:
            encoded = limits.encode([p.text for p in group], add_special_tokens=special)
        except Exception:
            encoded = [_encode_one(p, errors) for p in group]
        for p, ids in zip(group, encoded):
            p.token_ids = ids


def _encode_one(p: Pending, errors: dict[int, LineError]) -> list[int] | None:
    try:
        return p.limits.encode([p.text], add_special_tokens=p.add_special_tokens)[0]
    except Exception as e:
        errors[p.line] = LineError(p.line, p.custom_id, INVALID_PROMPT, f"tokenization failed: {str(e)[:300]}")
        return None
