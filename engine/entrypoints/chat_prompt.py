"""`LLM.chat`'s conversations to prompt text, with vLLM's options: a custom `chat_template`,
template variables, `add_generation_prompt` / `continue_final_message`, `tools`, and OpenAI
content-part lists (text parts joined by newlines; other part types are refused)."""

from __future__ import annotations

from collections.abc import Mapping


def _text_content(content) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"message content must be a string or a list of content parts, got {type(content).__name__}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"only text content parts are supported, got {kind or type(part).__name__!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _message(message) -> dict:
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError("each chat message must be a dict with a 'role'")
    return {**message, "content": _text_content(message.get("content"))}


def render_conversation(
    tokenizer,
    conversation: list,
    *,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
) -> str:
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be True")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass chat_template=...")
    messages = [_message(m) for m in conversation]
    if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
        raise ValueError("continue_final_message needs the conversation to end with an assistant message")
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        **dict(chat_template_kwargs or {}),
    )
