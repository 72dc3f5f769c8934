"""Prefill on one engine, decode on another (engine/kv_transfer/export.py): outputs equal one engine's."""

import pytest

from engine import SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.kv_transfer.export import KVBundle, model_fingerprint
from engine.testing.tiny import ARCHITECTURES
from tests.helpers import assert_pool_free, make_prompts

REMOTE_DECODE = {"kv_transfer_params": {"do_remote_decode": True}}


def drive(engine: LLMEngine, submit) -> dict:
    """Add `submit`'s requests ({id: (prompt, params)} or {id: (KVBundle, params)}) and step until done."""
    for rid, (first, params) in submit.items():
        if isinstance(first, KVBundle):
            engine.add_imported_request(rid, first, params)
        else:
            engine.add_request(rid, first, params)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    return outs


def params_for(i: int, n: int, **extra) -> SamplingParams:
    if i % 3 == 0:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **extra)
    if i % 3 == 1:  # seeded sampling, with logprobs (the first token's come over with the KV)
        return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=n, logprobs=2, **extra)
    return SamplingParams(
        temperature=1.0, top_k=20, seed=7 * i, max_tokens=n, repetition_penalty=1.2, min_tokens=min(n, 3), **extra
    )


def run_split(path, prompts, max_tokens, prefill_kwargs, decode_kwargs):
    prefill, decode = LLMEngine(str(path), **prefill_kwargs), LLMEngine(str(path), **decode_kwargs)
    first = drive(
        prefill,
        {
            f"r{i}": ({"prompt_token_ids": p}, params_for(i, n, extra_args=REMOTE_DECODE))
            for i, (p, n) in enumerate(zip(prompts, max_tokens))
        },
    )
    assert_pool_free(prefill)
    done = {rid: out for rid, out in first.items() if out.finished}
    handoff = {
        rid: (out.kv_export, params_for(int(rid[1:]), max_tokens[int(rid[1:])]))
        for rid, out in first.items()
        if not out.finished
    }
    assert all(b.first_token == first[rid].outputs[0].token_ids[0] for rid, (b, _) in handoff.items())
    done.update(drive(decode, handoff))
    assert_pool_free(decode)
    return done, prefill, decode


def assert_same_output(got, expected):
    """Tokens, text and finish exactly; logprobs to float noise (batches differ between the runs)."""
    a, b = got.outputs[0], expected.outputs[0]
    assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
        b.token_ids,
        b.text,
        b.finish_reason,
        b.stop_reason,
    ), got.request_id
    assert (a.logprobs is None) == (b.logprobs is None)
    if a.logprobs is not None:
        assert [list(p) for p in a.logprobs] == [list(p) for p in b.logprobs]
        flat = [lp.logprob for p in a.logprobs for lp in p.values()]
        assert flat == pytest.approx([lp.logprob for p in b.logprobs for lp in p.values()], abs=1e-4)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_split_equals_one_engine(tiny_model, arch):
    """Greedy and seeded, chunked prefill and prefix caching on both sides; the decode side reuses
    the shared prefixes it already holds instead of writing them again."""
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=5, count=12, shared_prefixes=True)
    max_tokens[0] = 1  # finishes on the prefill side, nothing to hand over
    kwargs = dict(max_num_batched_tokens=48, enable_prefix_caching=True)
    single = LLMEngine(str(path), **kwargs)
    expected = drive(
        single,
        {f"r{i}": ({"prompt_token_ids": p}, params_for(i, n)) for i, (p, n) in enumerate(zip(prompts, max_tokens))},
    )
    got, prefill, decode = run_split(path, prompts, max_tokens, kwargs, kwargs)
    assert sorted(got) == sorted(expected)
    for rid in expected:
        assert_same_output(got[rid], expected[rid])
    assert got["r0"].outputs[0].finish_reason == "length" and prefill.kv.stats["exported"] == len(prompts) - 1
    assert decode.kv.stats["imported"] == len(prompts) - 1
    assert decode.kv.stats["blocks_reused"] > 0
    assert decode.kv.stats["bytes_in"] == prefill.kv.stats["bytes_out"] > 0


def test_decode_side_preemption_and_abort(tiny_model):
    """A tight decode pool preempts imported sequences (they recompute locally) and still matches."""
    path = tiny_model("llama")
    prompts, _ = make_prompts(seed=6, count=10)
    max_tokens = [48] * len(prompts)
    single = LLMEngine(str(path))
    expected = drive(
        single,
        {f"r{i}": ({"prompt_token_ids": p}, params_for(i, n)) for i, (p, n) in enumerate(zip(prompts, max_tokens))},
    )
    got, _, decode = run_split(path, prompts, max_tokens, {}, dict(num_kv_blocks=24, max_num_batched_tokens=64))
    assert decode.stats["preemptions"] > 0
    for rid in expected:
        assert_same_output(got[rid], expected[rid])


def test_abort_pending_import_and_bad_bundles(tiny_model, tmp_path):
    path = tiny_model("llama")
    prefill = LLMEngine(str(path))
    out = drive(
        prefill, {"a": ({"prompt_token_ids": list(range(40))}, SamplingParams(max_tokens=5, extra_args=REMOTE_DECODE))}
    )["a"]
    bundle = out.kv_export
    assert bundle.num_blocks == 3 and len(bundle.layers) == 2 and not out.finished
    decode = LLMEngine(str(path))
    decode.add_imported_request("x", bundle, SamplingParams(max_tokens=5))
    decode.step()  # admitted: its blocks are taken
    assert decode.num_free_blocks() < decode.block_manager.num_blocks
    assert decode.abort_request("x")
    assert_pool_free(decode)
    decode.add_imported_request("y", bundle, SamplingParams(max_tokens=5))
    assert decode.abort_request("y")  # still queued
    decode.step()
    assert_pool_free(decode)
    with pytest.raises(ValueError, match="n=1"):
        decode.add_imported_request("z", bundle, SamplingParams(max_tokens=5, n=2))
    with pytest.raises(ValueError, match="n=1"):
        prefill.add_request("z", {"prompt_token_ids": [1, 2]}, SamplingParams(n=2, extra_args=REMOTE_DECODE))
    other = LLMEngine(str(tiny_model("llama", num_key_value_heads=1)))
    with pytest.raises(ValueError, match="does not fit"):
        other.add_imported_request("w", bundle, SamplingParams(max_tokens=5))
    bundle.layers[1] = (bundle.layers[1][0][:2], bundle.layers[1][1])
    with pytest.raises(ValueError, match="wrong shape"):
        decode.add_imported_request("v", bundle, SamplingParams(max_tokens=5))


def test_fingerprint_tells_weights_apart(tiny_model, tmp_path):
    from engine.testing.tiny import write_tiny_model

    a = write_tiny_model(tmp_path / "a", "llama", seed=1)
    b = write_tiny_model(tmp_path / "b", "llama", seed=2)
    c = write_tiny_model(tmp_path / "c", "llama", seed=1)
    assert model_fingerprint(a) == model_fingerprint(c) != model_fingerprint(b)


def test_blocks_the_decode_side_holds_are_not_sent(tiny_model):
    """The decode engine says which prefix blocks it has cached; the bundle leaves them out. If they are
    evicted before the import, the request is recomputed there and still matches."""
    path = tiny_model("qwen3")
    shared = list(range(100, 150))  # 3 full blocks + 2 tokens
    prompt = shared + [7, 8, 9, 10, 11, 12]
    params = dict(temperature=0.8, seed=5, max_tokens=10)
    single = LLMEngine(str(path))
    expected = drive(single, {"a": ({"prompt_token_ids": prompt}, SamplingParams(**params))})["a"]
    for evict in (False, True):
        decode = LLMEngine(str(path))
        drive(decode, {"warm": ({"prompt_token_ids": shared}, SamplingParams(max_tokens=1))})
        skip = decode.block_manager.num_cached_blocks(prompt)
        assert skip == 3
        prefill = LLMEngine(str(path))
        transfer = {"kv_transfer_params": {"do_remote_decode": True, "skip_blocks": skip}}
        out = drive(prefill, {"a": ({"prompt_token_ids": prompt}, SamplingParams(**params, extra_args=transfer))})
        bundle = out["a"].kv_export
        assert bundle.first_block == 3 and bundle.num_blocks == 1
        if evict:
            assert decode.block_manager.reset_prefix_cache()
        got = drive(decode, {"a": (bundle, SamplingParams(**params))})["a"]
        assert_same_output(got, expected)
        assert decode.kv.stats["recomputed"] == int(evict)
        assert decode.kv.stats["blocks_not_sent"] == (0 if evict else 3)
        assert_pool_free(decode)
