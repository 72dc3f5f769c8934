"""vLLM: tests/entrypoints/llm/test_generate.py (and test_prompt_validation.py, test_chat.py)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.exceptions import VLLMValidationError

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def test_multiple_sampling_params(llm: LLM):
    sampling_params = [
        SamplingParams(temperature=0.01, top_p=0.95),
        SamplingParams(temperature=0.3, top_p=0.95),
        SamplingParams(temperature=0.7, top_p=0.95),
        SamplingParams(temperature=0.99, top_p=0.95),
    ]
    outputs = llm.generate(PROMPTS, sampling_params=sampling_params)
    assert len(PROMPTS) == len(outputs)
    with pytest.raises(VLLMValidationError):
        llm.generate(PROMPTS, sampling_params=sampling_params[:3])
    outputs = llm.generate(PROMPTS, sampling_params=SamplingParams(temperature=0.3, top_p=0.95))
    assert len(PROMPTS) == len(outputs)
    outputs = llm.generate(PROMPTS, sampling_params=None)
    assert len(PROMPTS) == len(outputs)


def test_multiple_priority(llm: LLM):
    assert len(llm.generate(PROMPTS, sampling_params=None, priority=None)) == len(PROMPTS)
    assert len(llm.generate(PROMPTS, sampling_params=None, priority=[0] * len(PROMPTS))) == len(PROMPTS)
    assert len(llm.generate(PROMPTS, sampling_params=None, priority=1)) == len(PROMPTS)
    with pytest.raises(VLLMValidationError):
        llm.generate(PROMPTS, sampling_params=None, priority=[0] * (len(PROMPTS) - 1))
    with pytest.raises(VLLMValidationError):
        llm.generate(PROMPTS, sampling_params=None, priority=[])


def test_single_prompt_priority(llm: LLM):
    assert len(llm.generate(PROMPTS[0], sampling_params=None, priority=[0])) == 1
    assert len(llm.generate(PROMPTS[0], sampling_params=None, priority=1)) == 1


def test_max_model_len(small_llm):
    max_model_len = 40  # vLLM's 20 fits its prompts in GPT-2 tokens; the tiny tokenizer needs up to 38
    llm = small_llm(max_model_len=max_model_len)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_model_len + 10))
    for output in outputs:
        num_total_tokens = len(output.prompt_token_ids) + len(output.outputs[0].token_ids)
        assert num_total_tokens <= max_model_len


def test_log_stats(llm: LLM):
    outputs = llm.generate(PROMPTS, sampling_params=None)
    assert all(output.metrics is not None for output in outputs)


# tests/entrypoints/llm/test_prompt_validation.py


def test_empty_prompt(llm: LLM):
    with pytest.raises(ValueError, match="decoder prompt cannot be empty"):
        llm.generate([""])


def test_out_of_vocab_token(llm: LLM):
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [999999]})


# tests/entrypoints/llm/test_chat.py (the text model's tests)

SYSTEM = {"role": "system", "content": "You are a helpful assistant"}


def test_chat(llm: LLM):
    messages = [SYSTEM, {"role": "user", "content": "Explain the concept of entropy."}]
    assert len(llm.chat(messages)) == 1


def test_multi_chat(llm: LLM):
    conversation1 = [SYSTEM, {"role": "user", "content": "Explain the concept of entropy."}]
    conversation2 = [SYSTEM, {"role": "user", "content": "Explain what among us is."}]
    assert len(llm.chat([conversation1, conversation2])) == 2


def test_chat_tokenization_adds_no_special_tokens_twice(llm: LLM):
    """vLLM's test_llm_chat_tokenization_no_double_bos, for a template that starts with its own marker (the
    tiny tokenizer has no BOS): the prompt starts with exactly one <|im_start|>."""
    outputs = llm.chat([SYSTEM, {"role": "user", "content": "Hello!"}])
    prompt_token_ids = outputs[0].prompt_token_ids
    start = llm.get_tokenizer().convert_tokens_to_ids("<|im_start|>")
    assert prompt_token_ids[0] == start and prompt_token_ids[1] != start
