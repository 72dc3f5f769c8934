"""LLM.chat with vLLM's options: chat_template, chat_template_kwargs, add_generation_prompt,
continue_final_message, tools, and OpenAI content-part lists."""

from __future__ import annotations

import pytest

from engine import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
CONVERSATION = [{"role": "user", "content": "Hello, world!"}]


def prompt_text(llm, out) -> str:
    return llm.get_tokenizer().decode(out.prompt_token_ids)


def test_content_parts_render_like_a_string(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "world!"}]}]
    joined = [{"role": "user", "content": "Hello,\nworld!"}]
    a = llm.chat(parts, PARAMS, use_tqdm=False)[0]
    b = llm.chat(joined, PARAMS, use_tqdm=False)[0]
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].token_ids == b.outputs[0].token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="takes no images"):
        llm.chat(image, PARAMS, use_tqdm=False)


def test_generation_prompt_and_continue_final_message(llm):
    with_prompt = prompt_text(llm, llm.chat(CONVERSATION, PARAMS, use_tqdm=False)[0])
    assert with_prompt.endswith("<|im_start|>assistant\n")
    without = prompt_text(llm, llm.chat(CONVERSATION, PARAMS, use_tqdm=False, add_generation_prompt=False)[0])
    assert without.endswith("<|im_end|>\n")
    partial = CONVERSATION + [{"role": "assistant", "content": "The answer is"}]
    cont = prompt_text(
        llm, llm.chat(partial, PARAMS, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    )
    assert cont.endswith("<|im_start|>assistant\nThe answer is")
    with pytest.raises(ValueError, match="cannot both be True"):
        llm.chat(partial, PARAMS, use_tqdm=False, continue_final_message=True)


def test_custom_template_kwargs_and_tools(llm):
    template = (
        "{% if tools %}[tools: {{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
        "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = llm.chat(
        CONVERSATION,
        PARAMS,
        use_tqdm=False,
        chat_template=template,
        add_generation_prompt=False,
        chat_template_kwargs={"greeting": "Hi! "},
        tools=tools,
    )[0]
    assert prompt_text(llm, out) == "[tools: get_weather]Hi! Hello, world!"


def test_several_conversations(llm):
    outs = llm.chat([CONVERSATION, [{"role": "user", "content": "fox"}]], PARAMS, use_tqdm=False)
    assert len(outs) == 2 and outs[0].prompt_token_ids != outs[1].prompt_token_ids
