"""vLLM: tests/samplers/test_beam_search.py (text-only cases): beam search against transformers' num_beams,
token for token (float32 here: vLLM's half would not be exact on CPU)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling_params import BeamSearchParams


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos: the random model's EOS is noise
    return hf


def _hf_beam_search(hf, tokenizer, prompt, beam_width, max_tokens):
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            num_beams=beam_width,
            num_return_sequences=beam_width,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            length_penalty=1.0,
            early_stopping=False,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return out.tolist()


@pytest.mark.parametrize("max_tokens", [8, 16])
@pytest.mark.parametrize("beam_width", [1, 2, 4])
def test_beam_search_single_input(llm: LLM, hf_model, example_prompts, max_tokens, beam_width):
    example_prompts = example_prompts[:1]
    hf_outputs = [_hf_beam_search(hf_model, llm.get_tokenizer(), p, beam_width, max_tokens) for p in example_prompts]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=True)
    vllm_outputs = llm.beam_search([{"prompt": p} for p in example_prompts], params)
    for hf_output_ids, vllm_output in zip(hf_outputs, vllm_outputs):
        vllm_output_ids = [s.tokens for s in vllm_output.sequences]
        assert len(hf_output_ids) == len(vllm_output_ids)
        for j in range(len(hf_output_ids)):
            assert hf_output_ids[j] == vllm_output_ids[j]


def test_beam_search_with_concurrency_limit(llm: LLM, example_prompts):
    params = BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt": p} for p in example_prompts]
    outputs = llm.beam_search(prompts, params)
    limited = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in outputs] == [[s.tokens for s in o.sequences] for o in limited]


# tests/test_sampling_params.py, tests/v1/sample/test_logit_bias_oob.py


def test_max_tokens_none():
    """max_tokens=None is allowed: up to the model's context."""
    SamplingParams(temperature=0.01, top_p=0.1, max_tokens=None)


def test_max_tokens_none_generates_to_the_context(small_llm):
    llm = small_llm(max_model_len=48)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 48 - 3 and out.outputs[0].finish_reason == "length"


def test_logit_bias_out_of_vocab(llm: LLM):
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError):
        llm.generate("Hello", SamplingParams(logit_bias={vocab + 10: 1.0}))
    with pytest.raises(ValueError):
        llm.generate("Hello", SamplingParams(logit_bias={-1: 1.0}))
