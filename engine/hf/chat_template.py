"""Conversations to prompt text through the tokenizer's `apply_chat_template` (transformers' own, or
`engine.hf.light_tokenizer`'s rendering of it without transformers).

The engine's `LLM.chat` and the batch validator both render here, so a chat request gets the
same prompt whichever path runs it.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.hf.jinja_chat import OWN_ARGUMENTS


def render_chat(
    tokenizer, conversations: list[list[dict]], template_kwargs: Mapping | None = None, tools: list[dict] | None = None
) -> list[str]:
    """Each conversation through the chat template, with the generation prompt appended.

    Rendered in one `apply_chat_template` call. `template_kwargs` are variables for the template
    (such as Qwen3's ``enable_thinking``); they may not set `apply_chat_template`'s own arguments.
    """
    if not conversations:
        return []
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use completions instead")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(kwargs.keys() & OWN_ARGUMENTS)
    if reserved:
        raise ValueError(f"chat template variables may not set {', '.join(reserved)}")
    if tools:  # OpenAI's tool objects, for the template to list
        kwargs["tools"] = tools
    texts = tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True, **kwargs)
    return [texts] if isinstance(texts, str) else list(texts)
