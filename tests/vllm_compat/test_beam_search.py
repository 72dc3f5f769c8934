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
