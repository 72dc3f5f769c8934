"""`LLM.chat` conversations with image content parts: rendered through the chat template with
{"type": "image"} parts (as Hugging Face templates expect), the placeholders expanded on the text as
the transformers processor does, tokenized without special tokens (the template holds them)."""

from __future__ import annotations

from engine.multimodal.engine_requests import fetcher, prompt_processor
from engine.multimodal.request import chat_messages


def chat_image_prompt(
    engine,
    conversation: list,
    *,
    chat_template=None,
    chat_template_kwargs=None,
    add_generation_prompt=True,
    continue_final_message=False,
    tools=None,
) -> dict:
    processor = prompt_processor(engine)
    if processor is None:
        raise ValueError(f"{engine.model_config.path.name}: this model takes no images (image content parts)")
    messages, images = chat_messages(conversation, engine.config.limit_mm_per_prompt, fetch=fetcher(engine))
    text = engine.tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        **dict(chat_template_kwargs or {}),
    )
    return {"prompt": text, "add_special_tokens": False, "multi_modal_data": {"image": images}}
