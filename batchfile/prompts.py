"""Rendering chat prompts and tokenizing prompts for a chunk of validated lines, in batches
(one chat-template call per model and template arguments, one tokenizer call per tokenizer)."""

from __future__ import annotations

import json
import secrets

from batchfile.errors import CHAT_TEMPLATE_ERROR, CONTEXT_LENGTH_EXCEEDED, INVALID_PROMPT, LineError
from batchfile.model_limits import ModelLimits
from batchfile.validation import Pending

SCREEN_CHARS = 1 << 16  # texts longer than this are counted piece by piece before being tokenized whole
CUT_SLACK = 4  # tokens a cut between two pieces may add to their count (a word split in two)


_PLACEHOLDER = "\ue000pagedbatch-" + secrets.token_hex(8) + "-{}\ue000"  # cannot occur in an input by chance


def render(chunk: list[Pending], errors: dict[int, LineError]) -> None:
    """Set `text` of the chunk's chat lines; a line whose template fails gets an error instead."""
    groups: dict[tuple, list[Pending]] = {}
    for p in chunk:
        if p.messages is not None:
            _guard_content(p)
            kwargs = json.dumps(p.template_kwargs, sort_keys=True) if p.template_kwargs else ""
            tools = json.dumps(p.tools, sort_keys=True) if p.tools else ""
            groups.setdefault((id(p.limits), kwargs, tools), []).append(p)
    for group in groups.values():
        limits, kwargs = group[0].limits, group[0].template_kwargs
        try:
            texts = limits.render_chat([p.messages for p in group], kwargs, group[0].tools)
        except Exception:
            texts = [_render_one(p, errors) for p in group]  # find the offending conversation(s)
        for p, text in zip(group, texts):
            p.text = text


def _guard_content(p: Pending) -> None:
    """Unless the model opts out, message content holding special-token text is rendered as a
    placeholder and tokenized as plain text (`encode`), so a user cannot forge the template's markers."""
    if p.limits.special_tokens_in_content or not p.limits.special_strings or p.images:
        return  # (a line with images: its text goes to the worker's processor as rendered)
    plain: dict[str, str] = {}
    for message in p.messages:
        if p.limits.has_special_text(message["content"]):
            placeholder = _PLACEHOLDER.format(len(plain))
            plain[placeholder] = message["content"]
            message["content"] = placeholder
    p.plain_content = plain or None


def _render_one(p: Pending, errors: dict[int, LineError]) -> str | None:
    try:
        return p.limits.render_chat([p.messages], p.template_kwargs, p.tools)[0]
    except Exception as e:
        message = f"the chat template failed: {str(e)[:300]}"
        errors[p.line] = LineError(p.line, p.custom_id, CHAT_TEMPLATE_ERROR, message)
        return None


def screen_long(chunk: list[Pending], errors: dict[int, LineError]) -> None:
    """Fail the lines whose text certainly exceeds their model's context, before it is tokenized whole.

    A long text is tokenized in pieces of SCREEN_CHARS characters (cut at whitespace) and the
    counting stops once the context is passed, so a multi-megabyte prompt costs about a context's
    worth of tokenizing, in time and memory, whatever its size.
    """
    for p in chunk:
        if p.text is None or p.token_ids is not None or len(p.text) <= SCREEN_CHARS or p.line in errors:
            continue
        limit = p.limits.max_model_len
        at_least = _tokens_at_least(p.limits, p.text, limit)
        if at_least is not None:
            message = (
                f"the prompt is at least {at_least} tokens ({len(p.text):,} characters); "
                f"the model's context length is {limit} tokens"
            )
            errors[p.line] = LineError(p.line, p.custom_id, CONTEXT_LENGTH_EXCEEDED, message)


def _tokens_at_least(limits: ModelLimits, text: str, limit: int) -> int | None:
    """A lower bound on the text's tokens once it reaches `limit`, else None (it may fit)."""
    counted = cuts = start = 0
    while start < len(text):
        end = _cut(text, start + SCREEN_CHARS)
        counted += len(limits.encode([text[start:end]], add_special_tokens=False)[0])
        if counted - cuts * CUT_SLACK >= limit:
            return counted - cuts * CUT_SLACK
        start, cuts = end, cuts + 1
    return None


def _cut(text: str, at: int) -> int:
    """Where to end a piece near `at`: before the last whitespace of the 1,024 characters before it
    (tokens start at a space), else at `at`."""
    if at >= len(text):
        return len(text)
    window = text[max(at - 1024, 0) : at]
    space = max(window.rfind(" "), window.rfind("\n"))
    return at - len(window) + space if space > 0 else at


def to_encode(chunk: list[Pending], errors: dict[int, LineError]) -> list[list[Pending]]:
    """The lines whose text is still to tokenize, grouped by tokenizer and add_special_tokens."""
    groups: dict[tuple, list[Pending]] = {}
    for p in chunk:
        if p.token_ids is None and p.text is not None and p.line not in errors:
            key = (id(p.limits), p.add_special_tokens, p.line if p.plain_content else None)
            groups.setdefault(key, []).append(p)
    return list(groups.values())


def encode(groups: list[list[Pending]], errors: dict[int, LineError]) -> None:
    """Tokenize the groups in batches (the fast tokenizer releases the GIL: this runs in a thread)."""
    for group in groups:
        limits, special = group[0].limits, group[0].add_special_tokens
        try:
            if group[0].plain_content:  # a group of its own
                encoded = [limits.encode_guarded(group[0].text, group[0].plain_content, add_special_tokens=special)]
            else:
                encoded = limits.encode([p.text for p in group], add_special_tokens=special)
        except Exception:
            encoded = [_encode_one(p, errors) for p in group]
        for p, ids in zip(group, encoded):
            p.token_ids = ids


def _encode_one(p: Pending, errors: dict[int, LineError]) -> list[int] | None:
    try:
        if p.plain_content:
            return p.limits.encode_guarded(p.text, p.plain_content, add_special_tokens=p.add_special_tokens)
        return p.limits.encode([p.text], add_special_tokens=p.add_special_tokens)[0]
    except Exception as e:
        errors[p.line] = LineError(p.line, p.custom_id, INVALID_PROMPT, f"tokenization failed: {str(e)[:300]}")
        return None
