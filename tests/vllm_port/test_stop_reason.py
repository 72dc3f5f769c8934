"""vLLM: tests/detokenizer/test_stop_reason.py and tests/detokenizer/test_stop_strings.py (V1 cases)."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.sampling_params import SamplingParams

STOP_STR = ","  # vLLM's "." for distilgpt2; the tiny random model writes "," within its context, "." not always
SEED = 42
MAX_TOKENS = 1024


def test_stop_reason(llm: LLM, example_prompts):
    tokenizer = llm.get_tokenizer()
    stop_token_id = tokenizer.convert_tokens_to_ids(STOP_STR)
    outputs = llm.generate(
        example_prompts,
        sampling_params=SamplingParams(
            ignore_eos=True, seed=SEED, max_tokens=MAX_TOKENS, stop_token_ids=[stop_token_id]
        ),
    )
    for output in outputs:
        output = output.outputs[0]
        assert output.finish_reason == "stop"
        assert output.stop_reason == stop_token_id
    outputs = llm.generate(
        example_prompts,
        sampling_params=SamplingParams(ignore_eos=True, seed=SEED, max_tokens=MAX_TOKENS, stop=STOP_STR),
    )
    for output in outputs:
        output = output.outputs[0]
        assert output.finish_reason == "stop"
        assert output.stop_reason == STOP_STR
    outputs = llm.generate(example_prompts, sampling_params=SamplingParams(seed=SEED, max_tokens=MAX_TOKENS))
    for output in outputs:
        output = output.outputs[0]
        assert output.finish_reason == "length" or (output.finish_reason == "stop" and output.stop_reason is None)


# test_stop_strings: vLLM's expected texts come from llama-2's greedy story; here they are cut out of the
# tiny model's greedy text the same way (the stop string, a stop spanning tokens, one inside a token, a token id).

STORY = "A story about vLLM:\n"


def _test_stopping(
    llm, expected_output, expected_reason, stop=None, stop_token_ids=None, include_in_output=False, detokenize=True
):
    output = llm.generate(
        STORY,
        SamplingParams(
            temperature=0.0,
            max_tokens=200,
            stop=stop,
            stop_token_ids=stop_token_ids,
            include_stop_str_in_output=include_in_output,
            detokenize=detokenize,
        ),
    )[0].outputs[0]
    output_text = output.text if detokenize else llm.get_tokenizer().decode(list(output.token_ids))
    assert output_text == expected_output
    assert output.stop_reason == expected_reason


@pytest.fixture(scope="module")
def story(llm):
    out = llm.generate(STORY, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))[0].outputs[0]
    return out.text, list(out.token_ids)


def _first_new(text: str, start: int, length: int) -> tuple[int, str]:
    """The first substring of `length` characters at or after `start` that does not occur before."""
    for i in range(start, len(text) - length):
        piece = text[i : i + length]
        if "\ufffd" not in piece and piece.strip() and piece not in text[: i + length - 1]:
            return i, piece
    raise AssertionError("no such piece")


def test_stop_basic(llm, story):
    text, _ = story
    i, stop = _first_new(text, 5, 1)
    _test_stopping(llm, stop=[stop], include_in_output=False, expected_output=text[:i], expected_reason=stop)
    _test_stopping(llm, stop=[stop], include_in_output=True, expected_output=text[: i + 1], expected_reason=stop)


def test_stop_multi_tokens(llm, story):
    text, _ = story
    i, stop = _first_new(text, 10, 6)
    never = "\x00never"
    _test_stopping(llm, stop=[stop, never], include_in_output=False, expected_output=text[:i], expected_reason=stop)
    _test_stopping(llm, stop=[stop, never], include_in_output=True, expected_output=text[: i + 6], expected_reason=stop)


def test_stop_partial_token(llm, story):
    text, ids = story
    tokenizer = llm.get_tokenizer()
    # a stop string that begins inside a multi-character token
    for k in range(2, len(ids)):
        piece = tokenizer.decode([ids[k]])
        start = len(tokenizer.decode(ids[:k]))
        if len(piece) >= 2 and "\ufffd" not in piece and text[: start + 1].count(piece[1:]) == 0:
            stop = piece[1:]
            if stop not in text[: start + 1] and text.find(stop) == start + 1:
                break
    else:
        pytest.fail("no multi-character token")
    _test_stopping(llm, stop=[stop], include_in_output=False, expected_output=text[: start + 1], expected_reason=stop)
    _test_stopping(
        llm, stop=[stop], include_in_output=True, expected_output=text[: start + 1 + len(stop)], expected_reason=stop
    )


def test_stop_token_id(llm, story):
    text, ids = story
    tokenizer = llm.get_tokenizer()
    k = next(k for k in range(3, len(ids)) if ids[k] not in ids[:k])
    stop_id = ids[k]
    _test_stopping(
        llm,
        stop_token_ids=[stop_id],
        include_in_output=False,
        expected_output=tokenizer.decode(ids[:k]),
        expected_reason=stop_id,
    )
    _test_stopping(
        llm,
        stop_token_ids=[stop_id],
        include_in_output=True,
        expected_output=tokenizer.decode(ids[: k + 1]),
        expected_reason=stop_id,
    )
