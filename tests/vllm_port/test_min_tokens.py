"""vLLM: tests/v1/e2e/test_min_tokens.py. vLLM marks the stop-string and EOS cases xfail (bugs it had); they
pass here, so they are plain tests. The EOS case biases the tiny random model toward EOS (logit_bias), since
unlike opt-125m it does not end "Give a file extension." early by itself."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

GREEDY = 0.0


class MinTokensTestCase:
    def __init__(self, name, min_tokens, max_tokens, stop=None, expected_min_len=None, expected_exact_len=None):
        self.name, self.min_tokens, self.max_tokens, self.stop = name, min_tokens, max_tokens, stop
        self.expected_min_len = expected_min_len or min_tokens
        self.expected_exact_len = expected_exact_len


MIN_TOKENS_TEST_CASES = [
    MinTokensTestCase("basic_min_tokens_no_stop", 8, 20, None, 8),
    MinTokensTestCase("min_tokens_zero", 0, 10, None, 0),
    MinTokensTestCase("min_equals_max_no_stop", 15, 15, None, expected_exact_len=15),
    MinTokensTestCase(
        "min_tokens_with_comprehensive_stops", 5, 20, ["a", "e", "i", "o", "u", "t", "n", "s", "r", "l", " "], 5
    ),
    MinTokensTestCase("min_tokens_with_simple_char_stop", 3, 15, ["e", "a", " "], 3),
    MinTokensTestCase("min_equals_max_eos_only", 20, 20, None, expected_exact_len=20),
    MinTokensTestCase("large_min_tokens", 50, 60, None, 50),
    MinTokensTestCase("min_tokens_with_empty_stop_list", 5, 15, [], 5),
]


def _count(output) -> int:
    return len(output.outputs[0].token_ids)


@pytest.mark.parametrize("test_case", MIN_TOKENS_TEST_CASES, ids=lambda tc: tc.name)
def test_min_tokens_comprehensive(llm: LLM, test_case):
    params = SamplingParams(
        min_tokens=test_case.min_tokens,
        max_tokens=test_case.max_tokens,
        stop=test_case.stop,
        temperature=GREEDY,
        include_stop_str_in_output=True,
    )
    (output,) = llm.generate(["Hello"], params)
    if test_case.expected_exact_len is not None:
        assert _count(output) == test_case.expected_exact_len
    else:
        assert _count(output) >= (test_case.expected_min_len or 0)


def test_min_tokens_basic_functionality(llm: LLM):
    (output,) = llm.generate(["Once upon a time"], SamplingParams(min_tokens=10, max_tokens=20, temperature=GREEDY))
    assert 10 <= _count(output) <= 20


def test_min_tokens_stop_strings_bug(llm: LLM):
    params = SamplingParams(
        min_tokens=15, max_tokens=50, stop=["e"], temperature=GREEDY, include_stop_str_in_output=True
    )
    (output,) = llm.generate(["The quick brown fox"], params)
    assert _count(output) >= 15


def test_min_tokens_stop_strings_guaranteed_early_trigger(llm: LLM):
    params = SamplingParams(
        min_tokens=50,
        max_tokens=200,
        stop=["e", "a", "i", "o", "u", " ", "t", "n", "s", "r"],
        temperature=GREEDY,
        include_stop_str_in_output=True,
    )
    (output,) = llm.generate(["The cat"], params)
    if output.outputs[0].finish_reason == "stop":
        assert _count(output) >= 50


def test_min_tokens_eos_behavior(llm: LLM):
    eos_token_id = llm.get_tokenizer().eos_token_id
    prompt, max_toks = "Give a file extension.", 32
    likes_eos = {eos_token_id: 8.0}  # the tiny model's stand-in for a model that ends early
    (no_min,) = llm.generate([prompt], SamplingParams(max_tokens=max_toks, temperature=GREEDY, logit_bias=likes_eos))
    choice = no_min.outputs[0]
    assert choice.finish_reason == "stop"
    assert choice.stop_reason is None
    assert len(choice.token_ids) < max_toks
    (with_min,) = llm.generate(
        [prompt], SamplingParams(min_tokens=max_toks, max_tokens=max_toks, temperature=GREEDY, logit_bias=likes_eos)
    )
    choice = with_min.outputs[0]
    assert len(choice.token_ids) == max_toks
    assert choice.finish_reason == "length"
    assert eos_token_id not in choice.token_ids


def test_min_tokens_validation():
    SamplingParams(min_tokens=0, max_tokens=10)
    SamplingParams(min_tokens=5, max_tokens=10)
    SamplingParams(min_tokens=10, max_tokens=10)
    with pytest.raises(ValueError, match="min_tokens must be greater than or equal to 0"):
        SamplingParams(min_tokens=-1, max_tokens=10)
    with pytest.raises(ValueError, match="min_tokens must be less than or equal to max_tokens"):
        SamplingParams(min_tokens=15, max_tokens=10)
