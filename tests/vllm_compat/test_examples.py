"""vLLM's offline examples (basic generation, chat, logprobs, perplexity scoring, seeded sampling,
token-id prompts) written anew for `from engine import ...` and the tiny model: they run unchanged
apart from the import and the model path."""

from __future__ import annotations

import math

import pytest

from engine import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


@pytest.fixture(scope="module")
def example_llm(model_dir):
    # vLLM's example passes only model=; the rest keeps the tiny model on the CPU.
    return LLM(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        seed=0,
        tensor_parallel_size=1,
        trust_remote_code=True,
        max_model_len=512,
    )


def test_basic_example(example_llm):
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = example_llm.generate(PROMPTS, sampling_params)
    assert [o.prompt for o in outputs] == PROMPTS
    for output in outputs:
        generated_text = output.outputs[0].text
        assert isinstance(generated_text, str) and 1 <= len(output.outputs[0].token_ids) <= 16


def test_chat_example(example_llm):
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    sampling_params = SamplingParams(temperature=0.5)
    outputs = example_llm.chat(conversation, sampling_params, use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].outputs[0].finish_reason in ("stop", "length")
    batch = example_llm.chat([conversation, conversation[:2]], sampling_params, use_tqdm=False)
    assert len(batch) == 2


def test_logprobs_example(example_llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    output = example_llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    for token_id, position in zip(output.token_ids, output.logprobs):
        best = max(position.values(), key=lambda lp: lp.logprob)
        assert best.rank == 1 and position[token_id].rank == 1  # greedy picks the top token
        assert all(lp.decoded_token is not None for lp in position.values())


def test_perplexity_scoring_example(example_llm):
    """Score texts with prompt_logprobs=0 and max_tokens=1, as vLLM users compute perplexity."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = example_llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outputs:
        lps = [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
        perplexity = math.exp(-sum(lps) / len(lps))
        assert len(lps) == len(out.prompt_token_ids) - 1 and 1.0 < perplexity < 10_000


def test_seeded_sampling_and_token_prompts(example_llm):
    tokenizer = example_llm.get_tokenizer()
    ids = tokenizer(PROMPTS[2]).input_ids
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=8, n=3)
    a = example_llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    b = example_llm.generate([PROMPTS[1], PROMPTS[2]], params, use_tqdm=False)[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
