"""Sample logprobs as vLLM returns them: dict[int, Logprob(logprob, rank, decoded_token)] of the
model's raw distribution, the sampled token always present, -1 for the whole vocabulary,
cumulative_logprob; checked against transformers' log-softmax in float32."""

from __future__ import annotations

import pytest
import torch

from engine import Logprob, SamplingParams

PROMPT = "Paged attention"


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def reference_logprobs(hf_model, prompt_ids, output_ids) -> torch.Tensor:
    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float()
    p = len(prompt_ids)
    return torch.log_softmax(logits[p - 1 : p - 1 + len(output_ids)], dim=-1)


@pytest.mark.parametrize("logprobs", [-1, 5])
def test_logprobs_equal_transformers_with_ranks(llm, hf_model, logprobs):
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer(PROMPT).input_ids
    # Penalties and top_k change what is sampled, never the logprobs reported (vLLM's raw logprobs).
    params = SamplingParams(
        temperature=1.0, top_k=8, repetition_penalty=1.5, seed=4, max_tokens=8, ignore_eos=True, logprobs=logprobs
    )
    out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].outputs[0]
    ref = reference_logprobs(hf_model, prompt_ids, out.token_ids)
    vocab = ref.shape[-1]
    k = vocab if logprobs == -1 else logprobs
    assert len(out.logprobs) == len(out.token_ids) == 8
    total = 0.0
    for row, token, entry in zip(ref, out.token_ids, out.logprobs):
        assert all(isinstance(v, Logprob) for v in entry.values())
        assert next(iter(entry)) == token
        order = row.argsort(descending=True).tolist()
        assert set(entry) == set(order[:k]) | {token}
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[t]), abs=1e-4)
            # 1 = most likely; tokens within float noise (1e-4) of each other may rank either way
            assert int((row > row[t] + 1e-4).sum()) + 1 <= lp.rank <= int((row >= row[t] - 1e-4).sum())
            assert lp.decoded_token == tokenizer.decode([t])
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(
        float(ref.gather(1, torch.tensor(out.token_ids)[:, None]).sum()), abs=1e-3
    )


def test_logprobs_true_means_one_and_none_means_none(llm):
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=4, ignore_eos=True, logprobs=True)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert all(1 <= len(entry) <= 2 for entry in out.logprobs)  # the top token, plus the sampled one
    assert all(min(lp.rank for lp in entry.values()) == 1 for entry in out.logprobs)
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None
