"""Sampling through the whole engine on a tiny random model: seeds, truncation, penalties,
logprobs, n > 1, stop conditions, detokenized text and chat prompts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny import write_tiny_model
from tests.helpers import assert_pool_free

PROMPTS = [
    "Hello, world!",
    "The quick brown",
    "Paged attention",
    "0123",
    "Large language models",
    "Batch inference",
    "Continuous batching lets",
    "fox jumps over",
    "How are you today?",
    "key value cache",
    "one token at a time",
    "JSONL files",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=96)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def no_leak_after_each_test(llm):
    yield
    assert_pool_free(llm.llm_engine)


def greedy(max_tokens=16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def one(llm, prompt, params):
    return llm.generate(prompt, params)[0].outputs[0]


def hf_step_logits(hf_model, prompt_ids, output_ids) -> torch.Tensor:
    """Transformers' logits for each output position: row j predicts output token j."""
    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float()
    p = len(prompt_ids)
    return logits[p - 1 : p - 1 + len(output_ids)]


# ---- seeds ----------------------------------------------------------------------------

SEEDED_VARIANTS = [dict(), dict(top_p=0.8), dict(top_k=20), dict(min_p=0.05)]


def test_seeded_requests_are_independent_of_their_batch(llm):
    """Each seeded request (plain, top_p, top_k, min_p) gives the same tokens alone as in a
    batch with ten other requests, seeded and unseeded; another seed gives other tokens."""

    def seeded(seed, variant):
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True, **variant)

    targets = [seeded(1234 + i, v) for i, v in enumerate(SEEDED_VARIANTS)]
    alone = [one(llm, PROMPTS[i], p).token_ids for i, p in enumerate(targets)]
    assert all(len(t) == 6 for t in alone)
    others = [
        SamplingParams(
            temperature=1.0,
            max_tokens=2 + i % 5,
            ignore_eos=True,
            seed=(i if i % 2 else None),
            top_p=0.95 if i % 3 == 0 else 1.0,
        )
        for i in range(10)
    ]
    prompts = PROMPTS[4:9] + PROMPTS[:4] + PROMPTS[7:12]
    params = others[:5] + targets + others[5:]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert batched[5:9] == alone
    reseeded = [seeded(99 + i, v) for i, v in enumerate(SEEDED_VARIANTS)]
    other_seeds = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], reseeded)]
    assert all(x != y for x, y in zip(other_seeds, alone))


def test_unseeded_sampling_differs_between_requests(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([PROMPTS[0]] * 3, params)
    ids = [tuple(o.outputs[0].token_ids) for o in outs]
    assert len(set(ids)) == 3


def test_engine_seed_makes_an_unseeded_run_reproducible(model_dir):
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, top_p=0.9)

    def run(seed):
        llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=32, seed=seed)
        outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)]
        assert_pool_free(llm.llm_engine)
        return outs

    first = run(7)
    assert run(7) == first
    assert run(8) != first


def test_top_k_1_and_min_p_near_1_equal_greedy(llm):
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], greedy(12, ignore_eos=True))]
    for kw in (dict(top_k=1), dict(min_p=0.999), dict(top_p=1e-6)):
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, **kw)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)]
        assert got == ref, kw


@pytest.mark.parametrize("temperature", [1e-4, 1e-8, 1e-40])
def test_small_positive_temperature_is_raised_to_001_as_in_vllm(temperature):
    """vLLM raises positive temperatures below 0.01 to 0.01 (only 0 is greedy)."""
    assert SamplingParams(temperature=temperature).temperature == 0.01
    assert not SamplingParams(temperature=temperature).greedy
    assert SamplingParams(temperature=0.5).temperature == 0.5


def test_top_k_limits_sampled_tokens_to_the_k_most_likely(llm, hf_model):
    params = SamplingParams(temperature=1.0, top_k=3, seed=11, max_tokens=16, ignore_eos=True)
    prompt_ids = llm.get_tokenizer()(PROMPTS[2]).input_ids
    out = one(llm, {"prompt_token_ids": prompt_ids}, params)
    logits = hf_step_logits(hf_model, prompt_ids, out.token_ids)
    top3 = logits.topk(3).indices.tolist()
    assert all(tok in top for tok, top in zip(out.token_ids, top3))
    assert any(tok != top[0] for tok, top in zip(out.token_ids, top3))  # it really sampled


# ---- penalties ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_greedy(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], greedy(24, ignore_eos=True))]


def repeats(token_lists) -> int:
    return sum(len(t) - len(set(t)) for t in token_lists)


@pytest.mark.parametrize(
    "penalty",
    [dict(repetition_penalty=1.5), dict(presence_penalty=1.0), dict(frequency_penalty=1.0)],
    ids=lambda p: next(iter(p)),
)
def test_penalties_change_greedy_and_reduce_repeats(llm, plain_greedy, penalty):
    plain = plain_greedy
    outs = llm.generate(PROMPTS[:6], greedy(24, ignore_eos=True, **penalty))
    penalised = [o.outputs[0].token_ids for o in outs]
    assert penalised != plain
    assert repeats(plain) > 0
    assert repeats(penalised) < repeats(plain) / 2


@pytest.mark.parametrize(
    "penalty",
    [
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.8),
        dict(presence_penalty=0.7, frequency_penalty=0.4),
        dict(presence_penalty=-0.5),
    ],
    ids=str,
)
def test_penalised_greedy_follows_the_penalised_reference_logits(llm, hf_model, penalty):
    """Each greedy token is the argmax of transformers' logits with vLLM's penalty rules
    applied by hand (repetition: prompt and output tokens; presence/frequency: output only)."""
    params = greedy(12, ignore_eos=True, **penalty)
    p = params
    for prompt in PROMPTS[:3]:
        prompt_ids = llm.get_tokenizer()(prompt).input_ids
        out = one(llm, {"prompt_token_ids": prompt_ids}, params).token_ids
        logits = hf_step_logits(hf_model, prompt_ids, out)
        for j, tok in enumerate(out):
            row = logits[j].clone()
            history = prompt_ids + out[:j]
            seen = sorted(set(history))
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            counts = torch.bincount(torch.tensor(out[:j], dtype=torch.long), minlength=row.numel()).float()
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
            top2 = row.topk(2).values
            if top2[0] - top2[1] < 1e-4:  # a near tie may go either way
                continue
            assert tok == int(row.argmax()), (prompt, j)


# ---- logprobs -------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_match_transformers(llm, hf_model, temperature):
    k = 3
    # top_k=6 makes a sampled token fall both inside and outside the top 3.
    params = SamplingParams(temperature=temperature, top_k=6, seed=5, max_tokens=10, ignore_eos=True, logprobs=k)
    tokenizer = llm.get_tokenizer()
    sizes = set()
    for prompt in PROMPTS[:4]:
        prompt_ids = tokenizer(prompt).input_ids
        out = one(llm, {"prompt_token_ids": prompt_ids}, params)
        assert len(out.logprobs) == len(out.token_ids) == 10
        ref = torch.log_softmax(hf_step_logits(hf_model, prompt_ids, out.token_ids), dim=-1)
        for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            top = ref[j].topk(k)
            top_ids = top.indices.tolist()
            expected_size = k if tok in top_ids else k + 1
            assert len(entry) == expected_size
            sizes.add(len(entry))
            assert entry[tok].logprob == pytest.approx(float(ref[j, tok]), abs=1e-4)
            assert entry[tok].rank == int((ref[j] >= ref[j, tok]).sum())  # vLLM's rank: 1 = most likely
            assert list(entry)[0] == tok  # the sampled token comes first, as in vLLM
            assert set(entry) == set(top_ids) | {tok}
            for rank, t in enumerate(top_ids, 1):
                assert entry[t].logprob == pytest.approx(float(ref[j, t]), abs=1e-4)
                assert entry[t].rank == rank
                assert entry[t].decoded_token == tokenizer.decode([t])
    if temperature == 0.0:
        assert sizes == {k}
    else:
        assert sizes == {k, k + 1}


def test_logprobs_zero_returns_only_the_sampled_token(llm):
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=6, ignore_eos=True, logprobs=0)
    out = one(llm, PROMPTS[3], params)
    assert [list(e) for e in out.logprobs] == [[t] for t in out.token_ids]
    assert all(v.logprob <= 0 and v.rank >= 1 for e in out.logprobs for v in e.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)))
    assert one(llm, PROMPTS[3], greedy(6)).logprobs is None


# ---- n > 1 ----------------------------------------------------------------------------


def test_n_completions(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True)
    out = llm.generate(PROMPTS[4], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    again = llm.generate(PROMPTS[4], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    with pytest.raises(ValueError, match="n must be 1 when using greedy"):  # as vLLM
        SamplingParams(n=2, temperature=0.0)


# ---- stop conditions ------------------------------------------------------------------


def test_stop_string(llm):
    tokenizer = llm.get_tokenizer()
    base = one(llm, PROMPTS[0], greedy(24, ignore_eos=True))
    text, ids = base.text, base.token_ids
    pairs = [text[i : i + 2] for i in range(len(text) - 1)]
    start = next(i for i in range(3, len(pairs)) if pairs[i].isascii() and pairs[i].isalpha())
    stop = text[start : start + 2]
    pos = text.find(stop)
    # The token that completes the first occurrence of the stop string.
    prefixes = [tokenizer.decode(ids[: j + 1], skip_special_tokens=True) for j in range(len(ids))]
    last = next(j for j, prefix in enumerate(prefixes) if stop in prefix)
    out = one(llm, PROMPTS[0], greedy(24, ignore_eos=True, stop=[stop, "never-seen-stop"]))
    assert out.text == text[:pos]
    assert stop not in out.text
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.token_ids == ids[: last + 1]


def test_stop_string_before_min_tokens_does_not_end_the_run_later(llm):
    """Stop strings are checked from min_tokens on, and only in text that the newest token
    completed (as vLLM does): an occurrence wholly inside the first tokens must not fire
    later, nor cut the text back to before it."""
    tokenizer = llm.get_tokenizer()
    base = one(llm, PROMPTS[0], greedy(16, ignore_eos=True)).token_ids

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    stop = decode(base[:1]).strip()
    min_tokens = 4
    assert stop and stop in decode(base[: min_tokens - 1])  # it occurs before min_tokens
    out = one(llm, PROMPTS[0], greedy(16, ignore_eos=True, stop=[stop], min_tokens=min_tokens))
    assert len(out.token_ids) >= min_tokens
    assert out.token_ids == base[: len(out.token_ids)]
    full = decode(out.token_ids)
    if out.finish_reason == "stop":
        # The last token completed this occurrence; the text is cut right before it.
        before_last = decode(out.token_ids[:-1])
        pos = full.find(stop, max(0, len(before_last) - len(stop) + 1))
        assert pos >= 0, f"no stop string completed by the last token in {full!r}"
        assert out.text == full[:pos]
    else:
        assert out.finish_reason == "length"
        assert out.text == full


def test_stop_token_ids(llm):
    base = one(llm, PROMPTS[1], greedy(16, ignore_eos=True))
    ids = base.token_ids
    stop_tok = ids[4]
    first = ids.index(stop_tok)
    out = one(llm, PROMPTS[1], greedy(16, stop_token_ids=[stop_tok]))
    assert out.token_ids == ids[: first + 1]
    assert out.token_ids[-1] == stop_tok
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_tok
    # min_tokens suppresses the stop token until enough tokens are out.
    suppressed = one(llm, PROMPTS[1], greedy(16, stop_token_ids=[stop_tok], min_tokens=first + 3))
    assert stop_tok not in suppressed.token_ids[: first + 3]
    assert len(suppressed.token_ids) >= first + 3
    assert suppressed.token_ids[:first] == ids[:first]


def test_max_tokens_gives_length(llm):
    for max_tokens in (1, 5, 13):
        outs = llm.generate(PROMPTS[:3], greedy(max_tokens, ignore_eos=True))
        for o in outs:
            assert o.outputs[0].finish_reason == "length"
            assert o.outputs[0].stop_reason is None
            assert len(o.outputs[0].token_ids) == max_tokens


def test_text_is_the_decoded_token_ids(llm):
    tokenizer = llm.get_tokenizer()
    sampled = SamplingParams(temperature=1.5, seed=4, max_tokens=24, ignore_eos=True)
    params = [greedy(16, ignore_eos=True), sampled]
    for p in params:
        for o in llm.generate(PROMPTS[:8], p):
            c = o.outputs[0]
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
            assert o.prompt_token_ids == tokenizer(o.prompt).input_ids


def test_chat_applies_the_chat_template(llm):
    tokenizer = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "Hello, world!"}]
    expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = llm.chat(conversation, greedy(8))[0]
    assert out.prompt_token_ids == expected
    # The template really wrapped the message: ChatML markers around the encoded content.
    assert expected[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert expected.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 1
    direct = llm.generate({"prompt_token_ids": expected}, greedy(8))[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    # A list of conversations gives one output per conversation, in order.
    convs = [conversation, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "0123"}]]
    outs = llm.chat(convs, greedy(4))
    assert [o.prompt_token_ids for o in outs] == [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in convs
    ]


# ---- EOS ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eos_setup(llm, model_dir, tmp_path_factory):
    """A copy of the tiny model whose config names as EOS a token its greedy run emits early."""
    base = one(llm, PROMPTS[3], greedy(16, ignore_eos=True)).token_ids
    eos = base[3]
    first = base.index(eos)
    assert eos != 2 and 2 not in base[: first + 1]
    path = write_tiny_model(tmp_path_factory.mktemp("tiny_eos") / "model", eos_token_id=eos)
    eos_llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=32)
    return eos_llm, base, eos, first


def test_eos_stops_unless_ignored(eos_setup):
    eos_llm, base, eos, first = eos_setup
    out = one(eos_llm, PROMPTS[3], greedy(16))
    assert out.token_ids == base[: first + 1]
    assert out.finish_reason == "stop"
    # The config's EOS is not the tokenizer's: vLLM stops on it as on a stop token id.
    assert out.stop_reason == eos
    ignored = one(eos_llm, PROMPTS[3], greedy(16, ignore_eos=True))
    assert ignored.token_ids == base  # same weights: the run goes on exactly as before
    assert ignored.finish_reason == "length"
    assert_pool_free(eos_llm.llm_engine)


def test_min_tokens_suppresses_eos(eos_setup):
    eos_llm, base, eos, first = eos_setup
    out = one(eos_llm, PROMPTS[3], greedy(16, min_tokens=first + 2))
    assert eos not in out.token_ids[: first + 2]
    assert len(out.token_ids) >= first + 2
    assert out.token_ids[:first] == base[:first]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == eos
    else:
        assert len(out.token_ids) == 16
    assert_pool_free(eos_llm.llm_engine)


def test_tokenizer_eos_also_stops(llm, model_dir, eos_setup, tmp_path_factory):
    """The engine stops on the tokenizer's EOS too, not only on config.json's."""
    _, base, eos, first = eos_setup
    path = tmp_path_factory.mktemp("tiny_tok_eos") / "model"
    shutil.copytree(model_dir, path)
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    tok_config["eos_token"] = llm.get_tokenizer().convert_ids_to_tokens(eos)
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    tok_llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16)
    assert tok_llm.get_tokenizer().eos_token_id == eos
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == 2
    out = one(tok_llm, PROMPTS[3], greedy(16))
    assert out.token_ids == base[: first + 1]
    assert out.finish_reason == "stop"
    assert_pool_free(tok_llm.llm_engine)
