"""prompt_logprobs as vLLM returns them (scoring, perplexity): the first entry None, then each
prompt token's Logprob given the tokens before it, computed in the prefill's own forward passes,
equal to transformers' log-softmax in float32 whatever the chunking, preemption or prefix cache."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import assert_pool_free

PROMPT_IDS = [(7 * j + 3) % 500 + 4 for j in range(45)]  # three blocks of 16 and a partial one


@pytest.fixture(scope="module")
def reference(model_dir) -> torch.Tensor:
    """Row p: transformers' log-softmax predicting prompt token p + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT_IDS])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(entries, reference, k):
    assert len(entries) == len(PROMPT_IDS) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        row, token = reference[p], PROMPT_IDS[p + 1]
        assert next(iter(entry)) == token
        assert set(entry) == set(row.topk(k).indices.tolist()) | {token}
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[t]), abs=1e-4)
            assert int((row > row[t] + 1e-4).sum()) + 1 <= lp.rank <= int((row >= row[t] - 1e-4).sum())


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_transformers(llm, reference, k):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k)
    out = llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)[0]
    check(out.prompt_logprobs, reference, k)
    plain = llm.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


def test_all_vocabulary_prompt_logprobs(llm, reference):
    out = llm.generate(
        {"prompt_token_ids": PROMPT_IDS[:6]}, SamplingParams(max_tokens=1, prompt_logprobs=-1), use_tqdm=False
    )[0]
    assert all(len(entry) == reference.shape[-1] for entry in out.prompt_logprobs[1:])


def test_chunked_preempted_and_prefix_cached_prompts_give_the_same(model_dir, llm, reference):
    """A 5-token budget chunks the prompt; a small pool preempts; a prompt already in the prefix cache
    is recomputed for its logprobs (vLLM skips reading the cache for such requests)."""
    tight = LLM(
        str(model_dir), device="cpu", dtype="float32", num_kv_blocks=9, max_num_batched_tokens=5, max_num_seqs=4
    )
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    others = [{"prompt_token_ids": [(11 * j + i) % 500 + 4 for j in range(40)]} for i in range(2)]
    outs = tight.generate([{"prompt_token_ids": PROMPT_IDS}, *others], [params, params, params], use_tqdm=False)
    assert tight.llm_engine.stats["preemptions"] > 0
    check(outs[0].prompt_logprobs, reference, 2)
    again = tight.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    check(again.prompt_logprobs, reference, 2)
    assert (
        tight.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=1), use_tqdm=False)[
            0
        ].num_cached_tokens
        > 0
    )  # others still read the cache
    assert_pool_free(tight.llm_engine)
