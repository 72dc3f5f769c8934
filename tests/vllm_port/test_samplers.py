"""vLLM: tests/samplers/ (test_ignore_eos, test_seeded_generate, test_ranks, test_logprobs), tests/v1/engine/
test_llm_engine.py (parallel sampling, metrics), tests/v1/sample/test_logprobs.py's offline cases."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams


@pytest.mark.parametrize("max_tokens", [32, 128])
def test_ignore_eos(llm: LLM, example_prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for prompt in example_prompts:
        output = llm.generate(prompt, params)[0]
        assert max_tokens - len(output.outputs[0].token_ids) == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_random_sample_with_seed(llm: LLM, example_prompts, seed):
    rng = random.Random(seed)
    sampling_params = SamplingParams(
        temperature=2.0, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0
    )
    seeded_a = SamplingParams(temperature=2.0, seed=rng.randint(0, 100))
    seeded_b = SamplingParams(temperature=2.0, seed=rng.randint(101, 200))
    prompts, params = [], []
    for prompt in example_prompts:
        for p in (sampling_params, sampling_params, seeded_a, seeded_a, seeded_b, seeded_b):
            prompts.append(prompt)
            params.append(p)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for i in range(0, len(example_prompts) * 6, 6):
        assert outputs[i] != outputs[i + 1]  # unseeded: different
        assert outputs[i + 2] == outputs[i + 3]  # the same seed: the same
        assert outputs[i + 4] == outputs[i + 5]
        assert outputs[i + 2] != outputs[i + 4]  # other seeds: other outputs


def test_ranks(llm: LLM, example_prompts):
    num_top_logprobs = 5
    num_prompt_logprobs = 5
    max_tokens = 16
    greedy = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        max_tokens=max_tokens,
        logprobs=num_top_logprobs,
        prompt_logprobs=num_prompt_logprobs,
    )
    for result in llm.generate(example_prompts, greedy):
        assert result.prompt_logprobs is not None
        for token, lps in zip(result.prompt_token_ids[1:], result.prompt_logprobs[1:]):
            assert token in lps and lps[token].rank >= 1
        for token, lps in zip(result.outputs[0].token_ids, result.outputs[0].logprobs):
            assert lps[token].rank == 1  # greedy: the sampled token ranks first
    sampled = SamplingParams(max_tokens=max_tokens, logprobs=num_top_logprobs)
    for result in llm.generate(example_prompts, sampled):
        for token, lps in zip(result.outputs[0].token_ids, result.outputs[0].logprobs):
            assert token in lps and lps[token].rank >= 1
            others = {lp.rank for t, lp in lps.items() if t != token}
            assert others >= set(range(1, num_top_logprobs)) - {lps[token].rank}


@pytest.mark.parametrize("num_top_logprobs", [0, 3, 6])
@pytest.mark.parametrize("detokenize", [True, False])
def test_get_prompt_logprobs(llm: LLM, example_prompts, num_top_logprobs, detokenize):
    max_tokens = 5
    params = SamplingParams(
        max_tokens=max_tokens,
        logprobs=num_top_logprobs,
        prompt_logprobs=num_top_logprobs,
        temperature=0.0,
        detokenize=detokenize,
    )
    results = llm.generate(example_prompts, params)
    for result in results:
        assert result.prompt_logprobs[0] is None
        assert len(result.prompt_logprobs) == len(result.prompt_token_ids)
        for token, lps in zip(result.prompt_token_ids[1:], result.prompt_logprobs[1:]):
            assert token in lps and num_top_logprobs <= len(lps) <= num_top_logprobs + 1
        output = result.outputs[0]
        assert len(output.logprobs) == len(output.token_ids) == max_tokens
        for token, lps in zip(output.token_ids, output.logprobs):
            assert token in lps and num_top_logprobs <= len(lps) <= num_top_logprobs + 1
            for lp in lps.values():
                assert (lp.decoded_token is not None) == detokenize
        if detokenize:
            decoded = "".join(output.logprobs[i][t].decoded_token for i, t in enumerate(output.token_ids))
            assert decoded.replace("\ufffd", "") in output.text.replace("\ufffd", "") or output.text
        total = sum(lps[t].logprob for t, lps in zip(output.token_ids, output.logprobs))
        assert output.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_max_logprobs(llm: LLM):
    assert len(llm.generate("Hello", SamplingParams(logprobs=20, max_tokens=2))[0].outputs[0].logprobs[0]) >= 20
    with pytest.raises(ValueError):
        llm.generate("Hello", SamplingParams(logprobs=21, max_tokens=2))


def test_none_logprobs(llm: LLM, example_prompts):
    results = llm.generate(example_prompts, SamplingParams(max_tokens=5, logprobs=None, temperature=0.0))
    for result in results:
        assert result.outputs[0].logprobs is None
        assert result.outputs[0].cumulative_logprob is None
        assert result.prompt_logprobs is None


def test_zero_logprobs(llm: LLM, example_prompts):
    params = SamplingParams(max_tokens=5, logprobs=0, prompt_logprobs=0, temperature=0.0)
    for result in llm.generate(example_prompts, params):
        assert result.outputs[0].logprobs is not None
        assert result.outputs[0].cumulative_logprob is not None
        assert result.prompt_logprobs is not None
        assert all(len(lps) == 1 for lps in result.outputs[0].logprobs)  # the sampled token only
        assert all(len(lps) == 1 for lps in result.prompt_logprobs[1:])
        assert len(result.prompt_token_ids) == len(result.prompt_logprobs)


def test_all_logprobs(small_llm, example_prompts):
    llm = small_llm(max_logprobs=-1)
    params = SamplingParams(max_tokens=5, logprobs=-1, prompt_logprobs=-1)
    vocab = llm.llm_engine.model_config.vocab_size
    for result in llm.generate(example_prompts, params):
        for lps in result.outputs[0].logprobs:
            assert len(lps) == vocab
        for lps in result.prompt_logprobs[1:]:
            assert len(lps) == vocab


@pytest.mark.parametrize("n", [1, 2, 3])
def test_parallel_sampling(llm: LLM, example_prompts, n):
    """tests/v1/engine/test_llm_engine.py: n completions per prompt, each of max_tokens with ignore_eos."""
    params = SamplingParams(n=n, max_tokens=8, ignore_eos=True, temperature=1.0)
    for result in llm.generate(example_prompts, params):
        assert len(result.outputs) == n
        assert sorted(c.index for c in result.outputs) == list(range(n))
        assert all(len(c.token_ids) == 8 for c in result.outputs)


def test_engine_metrics(llm: LLM, example_prompts):
    """tests/v1/engine/test_llm_engine.py::test_engine_metrics, its counters."""
    before = {m.name: m for m in llm.get_metrics()}
    llm.generate(example_prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    after = {m.name: m for m in llm.get_metrics()}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in after
    assert after["vllm:generation_tokens"].value - before["vllm:generation_tokens"].value == 4 * len(example_prompts)
    assert after["vllm:prompt_tokens"].value > before["vllm:prompt_tokens"].value
    assert after["vllm:num_requests_running"].value == 0
