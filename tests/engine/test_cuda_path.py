"""The CUDA fast path's logic: padded decode steps through static buffers (replayed from
CUDA graphs on a GPU, run eagerly on CPU through `static_decode_eager`), no host reads in
a step except the sampler's one transfer, and the vectorised sampler.

On a GPU the same tests run for real: graphs are captured, compared with `enforce_eager`.
"""

from __future__ import annotations

import contextlib
import random
import sys
import warnings
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.sequence import Sequence
from engine.runner import device as engine_device
from engine.runner.cuda_graph import batch_size_ladder
from engine.sampling.sampler import Sampler
from tests.helpers import assert_pool_free, assert_same, make_prompts, reference

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
PADDED = {} if ON_CUDA else {"static_decode_eager": True}  # graphs on a GPU, their logic on CPU
UNPADDED = {"enforce_eager": True} if ON_CUDA else {}
ENGINE_DIR = str(Path(__file__).resolve().parents[2] / "engine")


def make_llm(path, **kwargs) -> LLM:
    kwargs = {"device": DEVICE, "dtype": "float32", "max_num_seqs": 12, **kwargs}
    return LLM(str(path), **kwargs)


def workload(seed: int = 0, count: int = 11, max_tokens: int = 24, max_prompt: int = 60):
    """Prompts of mixed lengths whose runs end at different steps, so that decode batches
    shrink through sizes between the ladder's rungs; greedy, seeded, penalised and
    logprob requests mixed."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, max_prompt))] for _ in range(count)]
    params = []
    for i in range(count):
        kw = dict(max_tokens=rng.randint(3, max_tokens), ignore_eos=True)
        if i % 4 == 1:
            kw.update(temperature=0.8, seed=100 + i, top_p=0.9)
        elif i % 4 == 2:
            kw.update(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.2, logprobs=2)
        elif i % 4 == 3:
            kw.update(temperature=1.0, seed=7, top_k=5, frequency_penalty=0.5, min_tokens=2)
        else:
            kw.update(temperature=0.0)
        params.append(SamplingParams(**kw))
    return prompts, params


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_pool_free(llm.llm_engine)
    return [o.outputs[0] for o in outs]


def slots_of(batch, block_size):
    slots = set()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            slots.add(seq.block_table[p // block_size] * block_size + p % block_size)
    return slots


def watch_steps(llm):
    """Wrap the runner's execute: per step, whether the padded path served it, the real and
    padded batch sizes, the slots its tokens own, and the slots whose K or V changed."""
    runner = llm.llm_engine.runner
    original = runner.execute
    log = []

    def execute(batch):
        before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        graphs = runner.graph_runner
        padded = graphs is not None and graphs.can_run(batch.num_new_tokens)
        size = graphs.padded_size(len(batch.seqs)) if padded else len(batch.seqs)
        expected = slots_of(batch, runner.block_size)
        logits = original(batch)
        changed = set()
        for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
            diff = ((k0 != k1) | (v0 != v1)).flatten(2).any(-1).flatten()
            changed |= set(diff.nonzero().flatten().tolist())
        log.append(dict(padded=padded, n=len(batch.seqs), size=size, expected=expected, changed=changed))
        return logits

    runner.execute = execute
    return log


def test_batch_size_ladder():
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(12) == [1, 2, 4, 8, 12]
    assert batch_size_ladder(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    full = batch_size_ladder(10_000)
    assert full[-1] == 512 and full == sorted(set(full))
    assert {80, 96, 240, 256, 288, 480} <= set(full)
    assert batch_size_ladder(100)[-3:] == [80, 96, 100]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_padded_decode_matches_the_unpadded_path(tiny_model, backend):
    """Same tokens (and logprobs) with decode steps padded through the static buffers as
    without; batches above cuda_graph_max_batch and mixed steps still run unpadded; a
    padded step writes K/V exactly at its real tokens' slots, never for padding."""
    path = tiny_model("qwen3")
    # The interpreter pays per program: fewer, shorter requests (still padded: 5 -> 8, 3 -> 4).
    prompts, params = workload(count=11) if backend == "torch" else workload(count=5, max_tokens=8, max_prompt=12)
    kwargs = dict(attention_backend=backend, cuda_graph_max_batch=8)
    expected = generate(make_llm(path, **kwargs, **UNPADDED), prompts, params)
    captured = ON_CUDA and backend == "triton"  # torch's reference attention cannot be captured
    llm = make_llm(path, **kwargs, **(PADDED if captured else {"static_decode_eager": True}))
    graphs = llm.llm_engine.runner.graph_runner
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    assert graphs.attention_hints == (backend == "triton")
    assert sorted(graphs.graphs) == (graphs.sizes if captured else [])
    steps = watch_steps(llm)
    got = generate(llm, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for a, b in zip(got, expected):
        if b.logprobs is None:
            assert a.logprobs is None
            continue
        for x, y in zip(a.logprobs, b.logprobs):
            assert list(x) == list(y)
            assert [v.logprob for v in x.values()] == pytest.approx([v.logprob for v in y.values()], abs=1e-5)

    padded = [s for s in steps if s["padded"]]
    assert any(s["size"] > s["n"] for s in padded), "no step was padded"
    assert {s["size"] for s in padded} <= set(graphs.sizes)
    if backend == "torch":
        assert any(not s["padded"] and s["n"] > 8 for s in steps)  # too large for the graphs
    assert any(not s["padded"] for s in steps)  # prefill steps
    for s in steps:
        assert s["changed"] <= s["expected"]
    for s in padded:
        assert s["changed"] == s["expected"]


def test_one_token_prompt_chunk_in_a_padded_step(tiny_model):
    """A 1-token chunk that does not finish its prompt rides in a decode-shaped step: it is
    padded with the rest but has no logits; greedy output still equals transformers'."""
    path = tiny_model("llama")
    prompts = [[5, 6], [7], [9], list(range(20, 40))]
    max_tokens = [30, 30, 30, 4]
    llm = make_llm(path, max_num_batched_tokens=4, max_num_seqs=4, **PADDED)
    steps = watch_steps(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = generate(llm, prompts, params)
    assert_same([o.token_ids for o in outs], reference(path, prompts, max_tokens))
    runner = llm.llm_engine.runner
    assert runner.graph_runner.sizes == [1, 2, 4]
    assert sum(s["padded"] and s["n"] == 4 for s in steps) >= 15  # 3 decodes + 1 prompt token
    assert all(s["changed"] == s["expected"] for s in steps if s["padded"])


def test_padded_decode_with_preemption_matches_transformers(tiny_model):
    """With a pool so small that sequences are preempted and recomputed (new block tables in
    rows that held others), padded decode steps still give transformers' greedy tokens."""
    path = tiny_model("qwen3")
    prompts, max_tokens = make_prompts(seed=1)
    llm = make_llm(path, num_kv_blocks=40, max_num_seqs=16, **PADDED)
    steps = watch_steps(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = generate(llm, prompts, params)
    assert llm.llm_engine.stats["preemptions"] > 0
    assert sum(s["padded"] for s in steps) > 10
    assert_same([o.token_ids for o in outs], reference(path, prompts, max_tokens))
    assert all(s["changed"] == s["expected"] for s in steps if s["padded"])


@contextlib.contextmanager
def count_host_reads():
    """Record every tensor -> Python conversion made by engine code, and every `fetch`. (`numpy()` is not
    among them: a CPU tensor's is a view, no read, and a device tensor's raises, so it cannot hide one.)"""
    names = ["item", "tolist", "__bool__", "__float__", "__int__", "__index__"]
    originals = {n: getattr(torch.Tensor, n) for n in names}
    own = {n for n in names if n in torch.Tensor.__dict__}
    reads, fetches = [], []

    def in_fetch(frame):  # PendingFetch.wait (what fetch calls), or a comprehension inside it
        return frame.f_code.co_name == "wait" or (frame.f_back and frame.f_back.f_code.co_name == "wait")

    def wrap(name, fn):
        def wrapper(self, *args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(ENGINE_DIR) and not in_fetch(frame):
                reads.append(f"{name} at {frame.f_code.co_filename}:{frame.f_lineno}")
            return fn(self, *args, **kwargs)

        return wrapper

    original_wait = engine_device.PendingFetch.wait

    def wait(self):
        lists = original_wait(self)
        fetches.append(len(lists))
        return lists

    for n in names:
        setattr(torch.Tensor, n, wrap(n, originals[n]))
    engine_device.PendingFetch.wait = wait
    try:
        yield reads, fetches
    finally:
        for n in names:
            if n in own:
                setattr(torch.Tensor, n, originals[n])
            else:
                delattr(torch.Tensor, n)
        engine_device.PendingFetch.wait = original_wait


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["padded", "unpadded"])
def test_a_step_reads_the_device_once(tiny_model, mode, async_scheduling):
    """Runner, model and sampler turn no tensor into a Python value except through one
    `fetch` per step (sampled tokens, with logprobs in the same transfer). The torch
    reference attention (pagedbatch_kernels/) is exempt: it is the CPU path. On a GPU, CUDA's sync
    debug mode also sees at most that one synchronisation per step."""
    path = tiny_model("qwen3")
    llm = make_llm(path, async_scheduling=async_scheduling, **(PADDED if mode == "padded" else UNPADDED))
    prompts, params = workload(seed=3, count=8)
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    steps = 0
    with count_host_reads() as (reads, fetches), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ON_CUDA:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
        finally:
            if ON_CUDA:
                torch.cuda.set_sync_debug_mode(0)
    assert_pool_free(engine)
    assert reads == []
    # one read per step; under async scheduling a step's read may come in the next call (then the last only reads)
    assert steps - async_scheduling <= len(fetches) <= steps
    assert any(n > 1 for n in fetches)  # logprobs ride along with the tokens
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= steps


# ---- the vectorised sampler against the per-row rules --------------------------------


def rowwise_penalties(logits, seqs):
    """vLLM's penalties one row at a time: repetition over prompt and output tokens,
    presence and frequency over output tokens."""
    logits = logits.clone()
    for i, seq in enumerate(seqs):
        p, row = seq.params, logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)))
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if seq.num_output_tokens:
            counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=row.numel()).float()
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def random_seqs(rng, count, vocab):
    seqs = []
    for i in range(count):
        kind = i % 5
        params = SamplingParams(
            repetition_penalty=[1.0, 1.4, 0.7, 1.0, 1.2][kind],
            presence_penalty=[0.0, 0.0, 0.5, -0.3, 1.5][kind],
            frequency_penalty=[0.0, 0.2, 0.0, 0.8, -1.0][kind],
            min_tokens=[0, 5, 0, 2, 50][kind],
            stop_token_ids=[[], [3, vocab + 5], [], [1], [4, 4]][kind],
            ignore_eos=kind == 3,
            max_tokens=100,
        )
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        seq = Sequence(i, str(i), 0, prompt, params)
        for _ in range(rng.randint(0, 12)):
            seq.append_token(rng.choice(prompt + [rng.randrange(vocab)]))
        seqs.append(seq)
    return seqs


def test_vectorised_penalties_and_stop_suppression_equal_the_rowwise_rules():
    rng = random.Random(0)
    vocab = 97
    seqs = random_seqs(rng, 23, vocab)
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(0)) * 3
    sampler = Sampler(vocab, torch.device("cpu"), 0)
    got = sampler._apply_penalties(logits.clone(), seqs)
    torch.testing.assert_close(got, rowwise_penalties(logits, seqs), rtol=1e-6, atol=1e-6)
    # Only the penalised rows, picked out of a larger batch, change.
    plain = [Sequence(100 + i, "p", 0, [1, 2, 3], SamplingParams()) for i in range(3)]
    mixed = plain[:1] + seqs[:4] + plain[1:]
    mixed_logits = torch.randn(len(mixed), vocab)
    got = sampler._apply_penalties(mixed_logits, mixed)
    torch.testing.assert_close(got, rowwise_penalties(mixed_logits, mixed), rtol=1e-6, atol=1e-6)

    suppressed = sampler._suppress_early_stops(logits, seqs, eos_ids=[2, 7])
    for i, seq in enumerate(seqs):
        p = seq.params
        banned = set()
        if seq.num_output_tokens < p.min_tokens:
            banned = {t for t in p.stop_token_ids + [2, 7] if t < vocab}  # EOS even with ignore_eos, as vLLM
        for t in range(vocab):
            assert suppressed[i, t] == (float("-inf") if t in banned else logits[i, t])


def test_sampler_greedy_rows_and_logprobs_in_a_mixed_batch():
    """Greedy rows take the argmax even beside sampled rows; logprobs come only for rows
    that ask, each with its own k, from the unpenalised distribution."""
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=0),
        SamplingParams(temperature=1.0, top_k=2, logprobs=1),
    ]
    seqs = [Sequence(i, str(i), 0, [5, 6], p) for i, p in enumerate(params)]
    tokens, logprobs = Sampler(vocab, torch.device("cpu"), 0)(logits, seqs, [])
    raw = torch.log_softmax(logits, dim=-1)
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[3] in logits[3].topk(2).indices.tolist()
    assert logprobs[1] is None
    assert logprobs[0].top_ids == logits[0].topk(3).indices.tolist()
    assert logprobs[2].top_ids == [] and logprobs[2].token_id == tokens[2]
    top1 = int(logits[3].argmax())
    assert logprobs[3].top_ids == [top1] and logprobs[3].token_id == tokens[3]
    for i in (0, 2, 3):
        entry = logprobs[i]
        assert entry.logprob == pytest.approx(float(raw[i, tokens[i]]), abs=1e-6)
        assert entry.rank == int((raw[i] >= raw[i, tokens[i]]).sum())
        for t, v in zip(entry.top_ids, entry.top_values):
            assert v == pytest.approx(float(raw[i, t]), abs=1e-6)


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does():
    """The sampler's greedy pick (`max(...).indices`, faster than `argmax` on the CPU) ties as
    argmax and transformers' greedy search: the lowest token id of the maximal logits."""
    vocab = 6000
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).float()
    tied = torch.arange(64) * 90 + 7
    logits[torch.arange(64), tied] = 9.0
    logits[torch.arange(64), tied + 3] = 9.0  # a second maximum after the first
    logits[torch.arange(64), torch.clamp(tied - 5, min=0)] = 8.5
    seqs = [Sequence(i, str(i), 0, [5, 6], SamplingParams(temperature=0.0)) for i in range(64)]
    tokens, _ = Sampler(vocab, torch.device("cpu"), 0)(logits, seqs, [])
    assert tokens == tied.tolist() == logits.argmax(dim=-1).tolist()
