"""Async scheduling (engine/core/async_steps.py): a step's tokens read one step late, the next step's
inputs fed from the sampled-token tensor. Greedy output equals transformers' with chunked prefill,
preemption and prefix-cache hits; greedy, seeded and logprob outputs equal the synchronous engine's;
steps with a sequence that needs its tokens on the host run synchronously beside deferred ones."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.core import async_steps
from tests.helpers import assert_pool_free, assert_same, hf_greedy, make_prompts
from tests.vision_helpers import picture, reference

_references: dict = {}


@pytest.fixture
def launches(monkeypatch):
    """How many steps were launched with their tokens read a step late."""
    count = [0]
    launch = async_steps.launch

    def counted(*args):
        count[0] += 1
        return launch(*args)

    monkeypatch.setattr(async_steps, "launch", counted)
    return count


def greedy(llm, prompts, max_tokens, **extra):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **extra) for n in max_tokens]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe", "deepseek_v2"])
def test_async_greedy_matches_transformers_chunked_preempted_prefix_cached(tiny_model, arch, launches):
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=2, shared_prefixes=True)
    key = (arch, str(path))
    if key not in _references:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        _references[key] = hf_greedy(model, prompts, max_tokens)
    llm = LLM(str(path), async_scheduling=True, max_num_batched_tokens=32, num_kv_blocks=40)
    assert llm.llm_engine.async_scheduling
    first = greedy(llm, prompts, max_tokens)
    again = greedy(llm, prompts, max_tokens)
    assert_same([o.outputs[0].token_ids for o in first], _references[key])
    assert_same([o.outputs[0].token_ids for o in again], _references[key])
    assert llm.llm_engine.stats["preemptions"] > 0
    assert sum(o.num_cached_tokens for o in again) > 0
    assert launches[0] > llm.llm_engine.stats["steps"] // 2
    assert_pool_free(llm.llm_engine)


def mixed_params(count: int) -> list[SamplingParams]:
    """Greedy and seeded random rows, stops by EOS (not ignored), stop strings and max_tokens, logprobs."""
    params = []
    for i in range(count):
        params.append(
            SamplingParams(
                max_tokens=6 + i % 9,
                temperature=0.0 if i % 3 == 0 else 0.9,
                top_p=0.9 if i % 4 == 1 else 1.0,
                seed=100 + i,
                ignore_eos=i % 2 == 0,
                stop=["e"] if i % 5 == 2 else None,
                logprobs=3 if i % 4 == 0 else None,
                n=2 if i % 7 == 4 and i % 3 else 1,
            )
        )
    return params


def outputs(outs):
    """What each completion got back; logprobs as (token, rank, text, value) rows, compared apart (a
    preemption at another step recomputes in other chunks: the values move in the last float32 bits)."""
    return [
        [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason)
            + tuple(zip(*[(t, lp.rank, lp.decoded_token, lp.logprob) for e in c.logprobs or [] for t, lp in e.items()]))
            for c in o.outputs
        ]
        for o in outs
    ]


def assert_same_outputs(ours, expected):
    """Tokens, texts, stops, logprob tokens, ranks and texts equal; logprob values within float32 noise."""
    assert [[c[:-1] for c in o] for o in ours] == [[c[:-1] for c in o] for o in expected]
    for o, e in zip(ours, expected):
        for c, d in zip(o, e):
            assert c[-1] == pytest.approx(d[-1], abs=1e-5) if len(c) > 4 else c == d


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 32, "num_kv_blocks": 100, "block_size": 4}, {"static_decode_eager": True}],
    ids=["whole", "chunked-preempted", "graph-buffers"],
)
def test_async_equals_sync_seeded_stops_and_logprobs(tiny_model, engine_args, launches):
    """Everything a request gets back is the same with its tokens read a step late: the token that a
    stopped sequence computed one step too many is dropped."""
    path = tiny_model("llama")
    prompts, _ = make_prompts(seed=3, count=20)
    params = mixed_params(len(prompts))
    runs = {}
    for mode in (False, True):
        llm = LLM(str(path), async_scheduling=mode, **engine_args)
        runs[mode] = outputs(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
        assert_pool_free(llm.llm_engine)
        if "num_kv_blocks" in engine_args:
            assert llm.llm_engine.stats["preemptions"] > 0
    assert launches[0] > 0
    assert_same_outputs(runs[True], runs[False])
    assert any(c[2] == "stop" for o in runs[True] for c in o)  # EOS or a stop string ended some


def test_length_stops_cost_no_extra_step(tiny_model):
    """A sequence whose step reaches its max_tokens gets no placeholder: it is not scheduled again, so
    the tokens computed are those of the synchronous engine, and one step more at most."""
    path = tiny_model("llama")
    prompts = [[5 + i, 9, 11] for i in range(8)]
    stats = {}
    for mode in (False, True):
        llm = LLM(str(path), async_scheduling=mode)
        greedy(llm, prompts, [12] * 8)
        stats[mode] = llm.llm_engine.stats
    assert stats[True]["tokens"] == stats[False]["tokens"]
    assert stats[True]["steps"] <= stats[False]["steps"] + 1


def test_host_dependent_requests_run_synchronously_beside_deferred_ones(tiny_model, launches):
    """Penalties, min_tokens, bad words and grammars read their tokens on the host: their steps are not
    deferred, while the others' around them are; every output as the synchronous engine gives it."""
    path = tiny_model("qwen3")
    prompts = [[3 + i, 40, 41, 42] for i in range(6)]
    host_bound = [
        SamplingParams(max_tokens=10, temperature=0.0, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, min_tokens=8),
        SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
    ]

    def plain(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    runs = {}
    for mode in (False, True):
        llm = LLM(str(path), async_scheduling=mode, max_num_seqs=3)
        # three plain ones start; the host-bound ones join the first while it decodes, as the others end
        params = [plain(24), plain(5), plain(6), *host_bound]
        runs[mode] = outputs(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
        assert_pool_free(llm.llm_engine)
        if mode:
            assert 0 < launches[0] < llm.llm_engine.stats["steps"]
    assert_same_outputs(runs[True], runs[False])


def test_abort_while_in_flight_frees_its_blocks(tiny_model):
    path = tiny_model("llama")
    llm = LLM(str(path), async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": [7, 8, 9 + i]}, params)
    for _ in range(4):
        assert engine.step() == []
    assert engine.in_flight is not None
    assert engine.abort_request("r1")
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    assert sorted(o.request_id for o in done) == ["r0", "r2"]
    assert all(len(o.outputs[0].token_ids) == 20 for o in done)
    assert_pool_free(engine)


def test_placeholders_never_reach_the_prefix_cache(tiny_model):
    """Blocks filled by decoding are offered to the prefix cache only once their tokens are read: a new
    request whose prompt is an earlier request's prompt and output hits them and continues the same."""
    path = tiny_model("llama")
    llm = LLM(str(path), async_scheduling=True, block_size=4)
    prompt = [11, 12, 13, 14, 15]
    first = greedy(llm, [prompt], [23])[0].outputs[0].token_ids
    extended = prompt + first[:20]
    second = greedy(llm, [extended], [3])[0]
    assert second.num_cached_tokens >= 20
    assert second.outputs[0].token_ids == first[20:23]
    assert all(h is None or len(h) > 0 for h in llm.llm_engine.block_manager.block_hashes)


def test_image_model_async_matches_transformers(tiny_model, launches):
    """M-RoPE positions and image rows with the decode inputs fed from the device, chunked through images."""
    path = tiny_model("qwen2.5-vl")
    llm = LLM(str(path), async_scheduling=True, max_num_batched_tokens=32)
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hello there<|im_end|>\n<|im_start|>assistant\n"
    images = [picture(1), picture(5, 48, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": [im]}} for im in images], params)
    assert [o.outputs[0].token_ids for o in outs] == [reference(path, text, [im], 10) for im in images]
    assert launches[0] > 0
    assert_pool_free(llm.llm_engine)


def test_off_by_default_on_the_cpu(tiny_model):
    assert not LLM(str(tiny_model("llama"))).llm_engine.async_scheduling


@pytest.mark.gpu
def test_async_on_cuda_with_graphs_equals_sync(tiny_model):
    """On a GPU (CUDA graphs for decodes, on by default there): the sampled tokens fed from the device
    into the graphs' static inputs, the read of a step waiting for its own event only."""
    path = tiny_model("qwen3")
    prompts, _ = make_prompts(seed=4, count=24)
    params = mixed_params(len(prompts))
    runs = {}
    for mode in (False, True):
        llm = LLM(str(path), device="cuda", dtype="float32", async_scheduling=mode)
        assert llm.llm_engine.async_scheduling is mode
        assert llm.llm_engine.runner.graph_runner is not None
        runs[mode] = outputs(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
        assert_pool_free(llm.llm_engine)
    assert_same_outputs(runs[True], runs[False])
