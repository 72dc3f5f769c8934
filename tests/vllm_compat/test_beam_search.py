"""LLM.beam_search equals transformers' generate(num_beams=k, do_sample=False) on tiny models of each
architecture. Matched: length_penalty 1, no EOS reachable (ignore_eos here, eos_token_id None there), so
every beam has the same length and both rank candidates by cumulative logprob alone. EOS handling (vLLM's:
finished beams set aside, scored without the EOS) is checked against a search run one request per beam
and step, as vLLM's offline beam search runs.

Beams are live sequences in the engine: the prompt is prefilled once, each step decodes every beam by one
token, and a child beam shares its parent's blocks (copy-on-write of the partial one), so the engine
computes each prompt's tokens once and one token per beam per later step."""

from __future__ import annotations

import json
from functools import cache

import pytest
import torch

from engine import LLM, BeamSearchParams, SamplingParams
from engine.beam.runner import worst_case_blocks
from engine.beam.search import BeamSearchSequence, best_sequences, next_beams
from engine.core.scheduler import ScheduledBatch
from engine.params.outputs import Logprob
from engine.testing.tiny import ARCHITECTURES
from engine.testing.tiny_vision import VISION_ARCHITECTURES

# block_size 4: lengths mid-block (7, 5, 10) and on a boundary (8, 12); decoding crosses boundaries too
PROMPTS = [
    [5, 9, 33, 70, 12, 8, 41],
    [100, 7, 7, 250, 3, 18, 90, 61],
    [200, 4, 4, 11, 300],
    [42, 1, 77, 19, 260, 8, 8, 130, 55, 21, 403, 66],
    [17, 222, 93, 5, 5, 5, 340, 12, 9, 180],
]
STEPS = 6


@cache
def hf_model(path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    quantized = json.loads((path / "config.json").read_text()).get("quantization_config", {})
    # an MXFP4 gpt-oss: transformers' own dequantisation (its default fetches Triton kernels from the hub)
    load = {"quantization_config": Mxfp4Config(dequantize=True)} if quantized.get("quant_method") == "mxfp4" else {}
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **load).eval()
    hf.generation_config.eos_token_id = None
    return hf


def hf_beams(path, prompt_ids, width: int, steps: int = STEPS) -> list[list[int]]:
    with torch.no_grad():
        out = hf_model(path).generate(
            torch.tensor([prompt_ids]),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,
            length_penalty=1.0,
            early_stopping=False,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    return out.tolist()


def search(llm, prompts, params):
    """The beam search's outputs, and how many tokens the engine computed (prefill and decode) for it."""
    before = llm.llm_engine.stats["tokens"]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    return outs, llm.llm_engine.stats["tokens"] - before


def assert_free(llm):
    engine = llm.llm_engine
    assert engine.num_free_blocks() == engine.block_manager.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


# Compared through AutoModelForCausalLM: not the image-text checkpoints (Mistral 3, LLaVA, Gemma 3 with images:
# their text models are tiny families of their own here).
# The tiny Phi-3's EOS (`<|end|>`, id 7) is a token its random weights pick: vLLM's beam score (ours) counts a beam
# that ends in EOS one token shorter even under ignore_eos, transformers (eos None) does not, so the two rank that
# candidate differently; the comparison's "no EOS reachable" premise fails there, not the engine.
BEAM_ARCHS = [
    pytest.param(a, marks=pytest.mark.xfail(strict=True, reason="the tiny Phi-3 reaches its EOS (see above)"))
    if a == "phi3"
    else a
    for a in ARCHITECTURES
    if a not in ("mistral3", *VISION_ARCHITECTURES)
]


@pytest.mark.parametrize("arch", BEAM_ARCHS)
def test_beam_search_equals_transformers(tiny_model, arch):
    path = tiny_model(arch)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=256)
    for width in range(1, 5):
        assert llm.reset_prefix_cache()  # each width computes its prompts afresh
        outs, computed = search(llm, PROMPTS, BeamSearchParams(beam_width=width, max_tokens=STEPS, ignore_eos=True))
        for prompt_ids, out in zip(PROMPTS, outs):
            assert [s.tokens for s in out.sequences] == hf_beams(path, prompt_ids, width)
            best = out.sequences[0]
            assert len(best.logprobs) == STEPS and best.finish_reason == "length"
            chosen = [entry[t].logprob for entry, t in zip(best.logprobs, best.tokens[len(prompt_ids) :])]
            assert best.cum_logprob == pytest.approx(sum(chosen))
            assert best.text == llm.get_tokenizer().decode(best.tokens)
        # Each prompt token once, then one token per beam and step: nothing recomputed.
        assert computed == sum(map(len, PROMPTS)) + len(PROMPTS) * width * (STEPS - 1)
        assert_free(llm)


def test_beam_search_with_the_default_block_size(tiny_model):
    """Prompts of 16 (a block exactly) and 21 tokens with the engine's usual 16-token blocks."""
    path = tiny_model("llama")
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64)
    prompts = [[(7 * i) % 300 + 3 for i in range(16)], [(11 * i) % 300 + 5 for i in range(21)]]
    outs, computed = search(llm, prompts, BeamSearchParams(beam_width=3, max_tokens=14, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert [s.tokens for s in out.sequences] == hf_beams(path, p, 3, 14)
    assert computed == 37 + 2 * 3 * 13
    metrics = {m.name: m.value for m in llm.get_metrics()}
    assert metrics["vllm:prompt_tokens"] == 37  # each prompt once
    assert metrics["vllm:generation_tokens"] == 2 * (1 + 3 * 13)  # a next token per beam and step
    assert_free(llm)


def test_a_failed_search_gives_every_block_back(tiny_model, monkeypatch):
    """An error mid-search (here: the device copy) or a pool where nothing can be scheduled ends the
    search with the error, every beam out of the engine and its blocks free; the engine goes on."""
    path = tiny_model("qwen2")
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=128)
    runner, calls = llm.llm_engine.runner, []
    copy_blocks = runner.copy_blocks

    def failing(pairs):
        calls.append(pairs)
        if len(calls) == 3:
            raise RuntimeError("device copy failed")
        copy_blocks(pairs)

    monkeypatch.setattr(runner, "copy_blocks", failing)
    params = BeamSearchParams(beam_width=3, max_tokens=STEPS, ignore_eos=True)
    with pytest.raises(RuntimeError, match="device copy failed"):
        search(llm, PROMPTS, params)
    assert_free(llm)
    monkeypatch.setattr(runner, "copy_blocks", copy_blocks)

    scheduler = llm.llm_engine.scheduler
    monkeypatch.setattr(scheduler, "schedule", lambda: ScheduledBatch([], []))
    with pytest.raises(RuntimeError, match="nothing could be scheduled"):
        search(llm, PROMPTS, params)
    assert_free(llm)
    monkeypatch.undo()
    outs, _ = search(llm, PROMPTS[:2], params)
    assert [s.tokens for s in outs[1].sequences] == hf_beams(path, PROMPTS[1], 3)


def test_copy_blocks_copies_every_layer_and_nothing_else(tiny_model):
    llm = LLM(str(tiny_model("qwen3")), device="cpu", dtype="float32", num_kv_blocks=8)
    runner = llm.llm_engine.runner
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.copy_blocks([(1, 5), (2, 6)])
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        for now, old in ((k, k0), (v, v0)):
            assert torch.equal(now[5], old[1]) and torch.equal(now[6], old[2])
            untouched = [0, 1, 2, 3, 4, 7]
            assert torch.equal(now[untouched], old[untouched])


def test_a_small_pool_runs_prompts_in_turn_and_a_too_small_one_is_refused(tiny_model):
    path = tiny_model("qwen2")
    params = BeamSearchParams(beam_width=4, max_tokens=STEPS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    need = max(worst_case_blocks(len(p), params, 4) for p in PROMPTS)
    small = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=need + 2)
    outs, computed = search(small, PROMPTS, params)
    for prompt_ids, out in zip(PROMPTS, outs):
        assert [s.tokens for s in out.sequences] == hf_beams(path, prompt_ids, 4)
    assert computed == sum(map(len, PROMPTS)) + len(PROMPTS) * 4 * (STEPS - 1)
    assert small.llm_engine.stats["preemptions"] == 0  # prompts waited for room; no beam was evicted
    assert_free(small)

    tiny = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=need - 1)
    with pytest.raises(ValueError, match=rf"prompt \d: beam search may need {need} KV blocks .* only {need - 1}"):
        tiny.beam_search(prompts, params)
    assert_free(tiny)
    (out,) = tiny.beam_search(prompts[:1], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    assert [s.tokens for s in out.sequences] == hf_beams(path, PROMPTS[0], 2, 3)


def test_other_requests_crowding_the_pool_make_beams_recompute_not_fail(tiny_model):
    """Requests outside the search take blocks it counted on: the scheduler preempts beams (and a
    fork may find no block for its copy); they are recomputed and the result is unchanged."""
    path = tiny_model("mistral")
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=24)
    engine = llm.llm_engine
    fork, dry_forks = engine.block_manager.fork, []

    def spy(parent, child):
        pair = fork(parent, child)
        if child.num_computed_tokens < parent.num_computed_tokens:
            dry_forks.append(child)
        return pair

    engine.block_manager.fork = spy
    for i in range(6):
        engine.add_request(
            f"other-{i}", {"prompt_token_ids": [i + 3] * 9}, SamplingParams(max_tokens=30, ignore_eos=True)
        )
    params = BeamSearchParams(beam_width=4, max_tokens=STEPS, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:3]], params)
    for prompt_ids, out in zip(PROMPTS, outs):
        assert [s.tokens for s in out.sequences] == hf_beams(path, prompt_ids, 4)
    assert engine.stats["preemptions"] > 0 and dry_forks
    while engine.has_unfinished_requests():
        engine.step()
    assert_free(llm)


def test_a_tight_token_budget_parks_beams_until_their_prompt_is_ready(tiny_model):
    """With 5 tokens a step, prefill chunks and decodes of different prompts split each prompt's
    beams over several steps; a beam that has its next-token logprobs waits for the others."""
    path = tiny_model("llama")
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=5)
    outs, computed = search(llm, PROMPTS, BeamSearchParams(beam_width=3, max_tokens=STEPS, ignore_eos=True))
    for prompt_ids, out in zip(PROMPTS, outs):
        assert [s.tokens for s in out.sequences] == hf_beams(path, prompt_ids, 3)
    assert computed == sum(map(len, PROMPTS)) + len(PROMPTS) * 3 * (STEPS - 1)
    assert_free(llm)


def test_beam_search_without_prefix_caching_and_with_sampling(tiny_model):
    """Forks share blocks by reference count alone: no prefix cache needed. With a temperature the
    sampled token joins each beam's candidates (vLLM's rule); the run still ends clean."""
    path = tiny_model("qwen3")
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=128, enable_prefix_caching=False)
    outs, computed = search(llm, PROMPTS[:3], BeamSearchParams(beam_width=2, max_tokens=STEPS, ignore_eos=True))
    for prompt_ids, out in zip(PROMPTS, outs):
        assert [s.tokens for s in out.sequences] == hf_beams(path, prompt_ids, 2)
    assert computed == sum(map(len, PROMPTS[:3])) + 3 * 2 * (STEPS - 1)
    (out,) = llm.beam_search({"prompt_token_ids": PROMPTS[0]}, BeamSearchParams(3, STEPS, temperature=1.0))
    assert len(out.sequences) == 3 and len({tuple(s.tokens) for s in out.sequences}) == 3
    for beam in out.sequences:
        outputs = beam.tokens[len(PROMPTS[0]) :]
        assert beam.cum_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(beam.logprobs, outputs)))
    assert_free(llm)


def test_beam_search_params_are_checked(tiny_model):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    llm = LLM(
        str(tiny_model("llama")), device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=4, max_model_len=32
    )
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="prompt 0: beam_width=5 exceeds max_num_seqs=4"):
        llm.beam_search(prompt, BeamSearchParams(beam_width=5, max_tokens=4))
    with pytest.raises(ValueError, match="prompt 1: .*exceed the model's context of 32"):
        llm.beam_search([prompt, {"prompt_token_ids": [5] * 20}], BeamSearchParams(beam_width=2, max_tokens=13))
    with pytest.raises(ValueError, match="temperature"):
        llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=4, temperature=-1.0))
    assert_free(llm)


def entry(table: dict[int, float]) -> dict[int, Logprob]:
    ranked = sorted(table.items(), key=lambda kv: -kv[1])
    return {t: Logprob(v, r) for r, (t, v) in enumerate(ranked, 1)}


def test_eos_finishes_a_beam_and_scores_without_it():
    """vLLM's rules on scripted logprobs: EOS (id 0) is likeliest after token 7."""

    def scripted(beam):
        return entry({0: -0.1, 7: -2.5, 8: -3.0} if beam.tokens[-1] == 7 else {7: -0.2, 8: -1.0, 0: -4.0})

    def search(params):
        live, finished = [BeamSearchSequence([5, 6])], []
        for _ in range(params.max_tokens):
            chosen, done = next_beams(live, [scripted(b) for b in live], 0, params)
            finished += done
            live = [b for _, b in chosen]

        class Tokenizer:
            def decode(self, ids):
                return " ".join(map(str, ids))

        return best_sequences(live, finished, 0, params, Tokenizer())

    from engine.beam.search import beam_search_score

    out = search(BeamSearchParams(beam_width=2, max_tokens=3))
    best = out.sequences[0]
    assert best.tokens == [5, 6, 7, 0] and best.finish_reason == "stop"  # ended by EOS at step 2
    assert best.cum_logprob == pytest.approx(-0.3) and best.text == "5 6 7 0"
    assert beam_search_score(best.tokens, best.cum_logprob, 0, 1.0) == pytest.approx(-0.3 / 3)  # EOS not counted
    assert all(s.finish_reason == ("stop" if s.tokens[-1] == 0 else "length") for s in out.sequences)
    assert all(0 not in s.tokens[2:-1] for s in out.sequences)  # nothing continues past EOS
    ignored = search(BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    assert all(len(s.tokens) == 5 for s in ignored.sequences)


def request_per_step_search(llm, prompt_ids, params):
    """The search as vLLM's offline beam search runs it: every beam its own one-token request."""
    step = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1)
    live, finished = [BeamSearchSequence(list(prompt_ids))], []
    for _ in range(params.max_tokens):
        if not live:
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens} for b in live], step, use_tqdm=False)
        chosen, done = next_beams(live, [o.outputs[0].logprobs[0] for o in outs], llm.llm_engine.eos_token_id, params)
        finished += done
        live = [b for _, b in chosen]
    return best_sequences(live, finished, llm.llm_engine.eos_token_id, params, llm.get_tokenizer())


def test_eos_beams_match_the_request_per_step_search(tiny_model):
    llm = LLM(str(tiny_model("qwen3")), device="cpu", dtype="float32", block_size=4, num_kv_blocks=256)
    prompt = PROMPTS[0]
    params = BeamSearchParams(beam_width=3, max_tokens=STEPS)
    (free_run,) = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(3, STEPS, ignore_eos=True))
    eos = free_run.sequences[0].tokens[len(prompt) + 1]
    llm.llm_engine.eos_token_id = eos  # a token the best beam meets at its second step
    (out,) = llm.beam_search({"prompt_token_ids": prompt}, params)
    expected = request_per_step_search(llm, prompt, params)
    assert [(s.tokens, s.finish_reason) for s in out.sequences] == [
        (s.tokens, s.finish_reason) for s in expected.sequences
    ]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([s.cum_logprob for s in expected.sequences])
    assert any(s.finish_reason == "stop" and s.tokens[-1] == eos for s in out.sequences)
    assert all(eos not in s.tokens[len(prompt) : -1] for s in out.sequences)
    assert_free(llm)
