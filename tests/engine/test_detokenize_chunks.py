"""Text decoded in one chunk when a sequence stops equals the text decoded token by token (issue 37: a
sequence without stop strings is not detokenized at every step)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.core.sequence import Sequence
from engine.hf.tokenizer import Detokenizer
from engine.testing.tiny import build_tokenizer


@pytest.fixture(scope="module")
def detokenizer():
    return Detokenizer(build_tokenizer(512))


def _seq(prompt, skip_special_tokens=True):
    return Sequence(0, "r", 0, prompt, SamplingParams(max_tokens=100, skip_special_tokens=skip_special_tokens))


def _ids(detokenizer, rng: random.Random, n: int) -> list[int]:
    """Random ids, with the byte tokens of multi-byte characters (held back until complete) among them."""
    tok = detokenizer.tokenizer
    out = []
    while len(out) < n:
        if rng.random() < 0.3:
            out += tok.encode(rng.choice(["é", "日本", "🙂", " ß", "—"]), add_special_tokens=False)
        else:
            out.append(rng.randrange(len(tok)))
    return out[:n]


@pytest.mark.parametrize("skip", [True, False])
def test_one_chunk_gives_the_text_of_token_by_token(detokenizer, skip):
    rng = random.Random(0)
    for _ in range(300):
        prompt, output = _ids(detokenizer, rng, rng.randint(1, 12)), _ids(detokenizer, rng, rng.randint(1, 20))
        end = rng.choice([None, len(prompt) + len(output) - 1])  # a stop token's text left out, or not
        stepwise, chunked = _seq(prompt, skip), _seq(prompt, skip)
        for token in output:
            stepwise.append_token(token)
            if end is None or len(stepwise.token_ids) <= end:
                detokenizer.decode_new_text(stepwise)
        detokenizer.flush(stepwise, end)
        for token in output:
            chunked.append_token(token)
        detokenizer.decode_new_text(chunked, end)
        detokenizer.flush(chunked, end)
        assert chunked.output_text == stepwise.output_text


def test_engine_text_equals_the_tokenizers_decode(tiny_model):
    """Without stop strings, the text comes out of one chunk at the end: still the decoded output ids."""
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 7, 30)]
    params.append(SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[5, 6, 7, 8, 9, 10]))
    outs = llm.generate([{"prompt_token_ids": [11, 12, 13, 14]}] * len(params), params, use_tqdm=False)
    tok = llm.llm_engine.tokenizer
    for out, p in zip(outs, params):
        completion = out.outputs[0]
        ids = completion.token_ids
        if completion.finish_reason == "stop":  # the stop token's text is left out
            ids = ids[:-1]
        assert completion.text == tok.decode(ids, skip_special_tokens=True)
        assert len(completion.token_ids) <= p.max_tokens
