"""Generation semantics as vLLM defines them: logit edits, stop tokens and strings in `.text`,
detokenize, prompt truncation, min_tokens against stop strings."""

from __future__ import annotations

import pytest

from engine import SamplingParams

PROMPT = "The quick brown"


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, **kw})


def run(llm, params, prompt=PROMPT):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_logit_bias_and_allowed_token_ids(llm):
    base = run(llm, greedy())
    forced = next(t for t in range(100, 200) if t not in base.token_ids)
    assert run(llm, greedy(logit_bias={forced: 100.0})).token_ids == [forced] * 16
    allowed = [forced, forced + 1, forced + 2]
    out = run(llm, SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed))
    assert set(out.token_ids) <= set(allowed)
    # A bias of -100 on the greedy choice removes it from that position.
    assert run(llm, greedy(logit_bias={base.token_ids[0]: -100.0})).token_ids[0] != base.token_ids[0]


def test_bad_words_are_never_completed(llm):
    tokenizer = llm.get_tokenizer()
    base = run(llm, greedy(max_tokens=24))
    # A generated token whose text is a word of its own (it encodes back to itself).
    token = next(
        t
        for t in base.token_ids
        if (w := tokenizer.decode([t]).strip()) and tokenizer.encode(w, add_special_tokens=False) == [t]
    )
    word = tokenizer.decode([token]).strip()
    out = run(llm, greedy(max_tokens=24, bad_words=[word]))
    assert token not in out.token_ids
    first = base.token_ids.index(token)
    assert out.token_ids[:first] == base.token_ids[:first]  # unchanged until the bad word would come


def test_include_stop_str_in_output(llm):
    base = run(llm, greedy(max_tokens=24))
    stop = base.text[6:8]
    cut = base.text.index(stop)
    without = run(llm, greedy(max_tokens=24, stop=[stop]))
    with_stop = run(llm, greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True))
    assert without.text == base.text[:cut] and without.stop_reason == stop
    assert with_stop.text == base.text[: cut + len(stop)] and with_stop.stop_reason == stop


def test_stop_token_text_is_left_out_unless_asked_for(llm):
    tokenizer = llm.get_tokenizer()
    base = run(llm, greedy())
    i = 4
    stop_token = base.token_ids[i]
    out = run(llm, greedy(stop_token_ids=[stop_token]))
    first = base.token_ids.index(stop_token)
    assert out.token_ids == base.token_ids[: first + 1]  # the stop token stays in token_ids
    assert out.stop_reason == stop_token
    assert out.text == tokenizer.decode(base.token_ids[:first], skip_special_tokens=True)
    kept = run(llm, greedy(stop_token_ids=[stop_token], include_stop_str_in_output=True))
    assert kept.text == tokenizer.decode(base.token_ids[: first + 1], skip_special_tokens=True)


def test_detokenize_false_gives_token_ids_only(llm):
    base = run(llm, greedy(logprobs=1))
    out = run(llm, greedy(detokenize=False, logprobs=1))
    assert out.token_ids == base.token_ids and out.text == "" and base.text
    assert all(lp.decoded_token is None for entry in out.logprobs for lp in entry.values())
    assert all(lp.decoded_token is not None for entry in base.logprobs for lp in entry.values())


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = list(range(30, 60))
    out = llm.generate({"prompt_token_ids": ids}, greedy(max_tokens=4, truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-10:]
    short = llm.generate({"prompt_token_ids": ids[-10:]}, greedy(max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == short.outputs[0].token_ids
    whole = llm.generate({"prompt_token_ids": ids}, greedy(max_tokens=4, truncate_prompt_tokens=-1), use_tqdm=False)
    assert whole[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate("hi", greedy(truncate_prompt_tokens=10**6), use_tqdm=False)


def test_min_tokens_text_cannot_complete_a_stop_string(llm):
    """vLLM: the text of the first min_tokens tokens is not searched for stop strings."""
    tokenizer = llm.get_tokenizer()
    base = run(llm, greedy(max_tokens=24))
    pos = next(i for i, c in enumerate(base.text) if c.isascii() and c.isalnum())
    stop = base.text[pos]
    m = next(k for k in range(1, 25) if len(tokenizer.decode(base.token_ids[:k])) > pos)  # tokens covering it
    early = run(llm, greedy(max_tokens=24, stop=[stop]))
    assert early.finish_reason == "stop" and len(early.token_ids) == m
    late = run(llm, greedy(max_tokens=24, stop=[stop], min_tokens=m))
    assert len(late.token_ids) > m
    assert late.token_ids == base.token_ids[: len(late.token_ids)]
    if late.finish_reason == "stop":  # at a later occurrence, produced after the first m tokens
        start = len(tokenizer.decode(base.token_ids[:m])) - 1
        assert stop in tokenizer.decode(base.token_ids[: len(late.token_ids)])[start:]


def test_min_tokens_bans_eos_even_with_ignore_eos(llm):
    """vLLM bans every stop id (EOS included) below min_tokens, ignore_eos or not."""
    eos = llm.llm_engine.eos_token_id
    out = run(llm, greedy(max_tokens=6, min_tokens=4, logit_bias={eos: 100.0}))
    assert eos not in out.token_ids[:4]
    assert out.token_ids[4:] == [eos, eos]  # ignore_eos: EOS may come after min_tokens and does not stop


def test_output_kind_is_accepted_and_generate_returns_finished_outputs(llm):
    from engine import RequestOutputKind

    outs = {kind: run(llm, greedy(max_tokens=5, output_kind=kind)) for kind in RequestOutputKind}
    assert len({tuple(o.token_ids) for o in outs.values()}) == 1
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in outs.values())


def test_spaces_between_special_tokens_is_a_no_op_with_fast_tokenizers(llm):
    special = llm.get_tokenizer().convert_tokens_to_ids("<|im_start|>")
    params = dict(max_tokens=6, logit_bias={special: 100.0}, skip_special_tokens=False)
    a = run(llm, greedy(**params, spaces_between_special_tokens=True))
    b = run(llm, greedy(**params, spaces_between_special_tokens=False))
    assert a.text == b.text == "<|im_start|>" * 6
