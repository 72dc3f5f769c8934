"""vLLM's SamplingParams: every field, its validation, clone(), and fields changed after construction."""

from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, RequestOutputKind, SamplingParams

VOCAB = 512


def test_every_vllm_field_is_accepted():
    params = SamplingParams(
        n=2,
        best_of=2,
        temperature=0.7,
        top_p=0.9,
        top_k=-1,
        min_p=0.05,
        max_tokens=8,
        min_tokens=1,
        stop=["x"],
        stop_token_ids=[3, 3, 4],
        include_stop_str_in_output=True,
        ignore_eos=True,
        seed=7,
        presence_penalty=0.1,
        frequency_penalty=0.1,
        repetition_penalty=1.1,
        logprobs=2,
        prompt_logprobs=None,
        bad_words=["foo", "foo"],
        logit_bias={"5": 1.5},
        allowed_token_ids=[1, 2],
        detokenize=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        truncate_prompt_tokens=4,
        logits_processors=[],
        output_kind=RequestOutputKind.FINAL_ONLY,
        extra_args={"plugin": 1},
    )
    assert params.top_k == 0  # -1 means no cut, stored as 0 like vLLM
    assert params.stop_token_ids == [3, 4] and params.bad_words == ["foo"]  # duplicates dropped, as vLLM
    assert params.logit_bias == {5: 1.5}  # JSON-style string keys become token ids
    assert params.extra_args == {"plugin": 1}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=3.0), "temperature"),
        (dict(temperature=-0.1), "temperature"),
        (dict(n=2, temperature=0.0), "n must be 1 when using greedy"),
        (dict(best_of=3), "best_of"),
        (dict(logprobs=-2), "logprobs"),
        (dict(prompt_logprobs=-5), "prompt_logprobs"),
        (dict(logits_processors=[lambda ids, logits: logits]), "logits_processors is not supported"),
        (dict(stop="x", detokenize=False), "detokenize"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(logit_bias={"a": 1.0}), "logit_bias"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(output_kind="delta"), "output_kind"),
    ],
)
def test_vllm_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_vllm_normalisations():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams().stop == []
    assert SamplingParams(logprobs=True).logprobs == 1
    assert SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2).top_k == 0  # greedy ignores cuts
    assert SamplingParams(temperature=2.0).temperature == 2.0


def test_clone_is_deep():
    params = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    copy = params.clone()
    copy.stop.append("b")
    copy.logit_bias[1] = 5.0
    assert params.stop == ["a"] and params.logit_bias == {1: 2.0}
    assert dataclasses.asdict(params.clone()) == dataclasses.asdict(params)


def test_stop_set_after_construction_takes_effect(llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = llm.generate("Hello, world!", params, use_tqdm=False)[0].outputs[0]
    params.stop = base.text[5:7]
    out = llm.generate("Hello, world!", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == base.text[5:7]
    assert base.text.startswith(out.text) and len(out.text) <= 5


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids", "logit_bias"])
def test_out_of_vocabulary_token_ids_are_rejected(llm, field):
    value = {VOCAB: 1.0} if field == "logit_bias" else [VOCAB]
    with pytest.raises(ValueError, match=f"{field}.*outside the vocabulary"):
        llm.generate("hi", SamplingParams(**{field: value}), use_tqdm=False)


def test_logprobs_above_max_logprobs_are_rejected(model_dir):
    small = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=8, max_logprobs=3)
    with pytest.raises(ValueError, match="at most 3"):
        small.generate("hi", SamplingParams(logprobs=4), use_tqdm=False)
    with pytest.raises(ValueError, match="at most 3"):
        small.generate("hi", SamplingParams(logprobs=-1), use_tqdm=False)
