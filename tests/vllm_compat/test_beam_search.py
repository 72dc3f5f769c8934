"""LLM.beam_search equals transformers' generate(num_beams=k, do_sample=False) on tiny models of each
architecture. Matched: length_penalty 1, no EOS reachable (ignore_eos here, eos_token_id None there), so
every beam has the same length and both rank candidates by cumulative logprob alone."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, BeamSearchParams
from engine.tiny import ARCHITECTURES

PROMPTS = [[5, 9, 33, 70, 12, 8, 41], [100, 7, 7, 250, 3]]
WIDTH, STEPS = 3, 6


def hf_beams(path, prompt_ids) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), num_beams=WIDTH, num_return_sequences=WIDTH, do_sample=False,
                          max_new_tokens=STEPS, min_new_tokens=STEPS, length_penalty=1.0, early_stopping=False,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out.tolist()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_beam_search_equals_transformers(tiny_model, arch):
    path = tiny_model(arch)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS, ignore_eos=True))
    for prompt_ids, out in zip(PROMPTS, outs):
        assert [s.tokens for s in out.sequences] == hf_beams(path, prompt_ids)
        best = out.sequences[0]
        assert len(best.logprobs) == STEPS and best.finish_reason == "length"
        chosen = [entry[t].logprob for entry, t in zip(best.logprobs, best.tokens[len(prompt_ids):])]
        assert best.cum_logprob == pytest.approx(sum(chosen))
        assert best.text == llm.get_tokenizer().decode(best.tokens)
    # Beams share their prompt's full blocks through the prefix cache; nothing is left held.
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.block_manager.num_blocks


def test_beam_search_params_are_checked():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)


class ScriptedLLM:
    """An LLM whose next-token logprobs are fixed: EOS (id 0) is likeliest after token 7."""

    eos = 0

    class llm_engine:  # noqa: N801 - the attribute name beam_search reads
        eos_token_id = 0

    def get_tokenizer(self):
        class Tokenizer:
            def decode(self, ids):
                return " ".join(map(str, ids))

        return Tokenizer()

    def generate(self, prompts, params, use_tqdm):
        from engine.outputs import CompletionOutput, Logprob, RequestOutput

        outs = []
        for p in prompts:
            last = p["prompt_token_ids"][-1]
            table = {0: -0.1, 7: -2.5, 8: -3.0} if last == 7 else {7: -0.2, 8: -1.0, 0: -4.0}
            entry = {t: Logprob(v, r) for r, (t, v) in enumerate(sorted(table.items(), key=lambda kv: -kv[1]), 1)}
            outs.append(RequestOutput("x", None, p["prompt_token_ids"], [CompletionOutput(0, "", [], "length",
                                                                                          logprobs=[entry])]))
        return outs


def test_eos_finishes_a_beam_and_scores_without_it():
    from engine.beam_search import beam_search_score, run_beam_search

    (out,) = run_beam_search(ScriptedLLM(), [[5, 6]], BeamSearchParams(beam_width=2, max_tokens=3))
    best = out.sequences[0]
    assert best.tokens == [5, 6, 7, 0] and best.finish_reason == "stop"  # ended by EOS at step 2
    assert best.cum_logprob == pytest.approx(-0.3)
    assert beam_search_score(best.tokens, best.cum_logprob, 0, 1.0) == pytest.approx(-0.3 / 3)  # EOS not counted
    assert all(s.finish_reason == ("stop" if s.tokens[-1] == 0 else "length") for s in out.sequences)
    assert all(0 not in s.tokens[2:-1] for s in out.sequences)  # nothing continues past EOS
    ignored = run_beam_search(ScriptedLLM(), [[5, 6]], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    assert all(len(s.tokens) == 5 for s in ignored[0].sequences)


class RecordingLLM:
    """A real LLM whose generate calls (one per beam search step) are recorded."""

    def __init__(self, llm):
        self.llm, self.llm_engine, self.steps = llm, llm.llm_engine, []

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def generate(self, prompts, params, use_tqdm):
        outs = self.llm.generate(prompts, params, use_tqdm=use_tqdm)
        self.steps.append(outs)
        return outs


def test_beams_share_every_computed_full_block_and_recompute_only_the_partial_one(tiny_model):
    """What is shared today: every step reads each beam's full blocks (prompt and output) from the
    prefix cache, which its parent beam computed; only the tokens of the last partial block (at
    most block_size) are computed again per beam and step. (No fork with copy-on-write yet.)"""
    from engine.beam_search import run_beam_search

    llm = LLM(str(tiny_model("llama")), device="cpu", dtype="float32", num_kv_blocks=256)
    bs = llm.llm_engine.block_manager.block_size
    prompt = [(7 * i) % 200 + 3 for i in range(3 * bs + 2)]  # three full blocks and a partial one
    spy = RecordingLLM(llm)
    run_beam_search(spy, [prompt], BeamSearchParams(beam_width=WIDTH, max_tokens=bs + 3, ignore_eos=True))
    assert len(spy.steps) == bs + 3
    for step, outs in enumerate(spy.steps[1:], 1):
        assert len(outs) == WIDTH  # every live beam, each its own request
        for out in outs:
            n = len(out.prompt_token_ids)
            assert n == len(prompt) + step
            assert out.num_cached_tokens == (n - 1) // bs * bs  # all the parent computed, in whole blocks
            assert n - out.num_cached_tokens <= bs
    computed = sum(len(o.prompt_token_ids) - o.num_cached_tokens for outs in spy.steps for o in outs)
    assert computed < sum(len(o.prompt_token_ids) for outs in spy.steps for o in outs) / 3
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.block_manager.num_blocks
