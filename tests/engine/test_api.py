"""The step API (LLMEngine) and the LLM front: threads, aborts, bad input, bad model dirs."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.testing.tiny import write_tiny_model
from tests.helpers import assert_pool_free

VOCAB = 512  # the tiny model's vocabulary


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=48, max_num_seqs=8)


@pytest.fixture
def engine(llm):
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    assert_pool_free(engine)  # the previous test left nothing behind either
    yield engine
    assert_pool_free(engine)


def prompt(i: int, length: int = 6) -> dict:
    """A distinct token-id prompt (distinct first block, so no prefix sharing)."""
    return {"prompt_token_ids": [(17 * i + 5 * j + 4) % VOCAB for j in range(length)]}


def greedy(max_tokens=6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def clean_run(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def drain(engine, max_steps=1000) -> dict:
    """Step until nothing is left; returns {request_id: RequestOutput}, each seen once."""
    results = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return results
        for out in engine.step():
            assert out.request_id not in results
            results[out.request_id] = out
    raise AssertionError("the engine did not finish")


# ---- concurrency ----------------------------------------------------------------------


def test_add_request_from_threads_while_stepping(llm, engine):
    params = greedy(4)
    expected = {f"t{t}-{j}": prompt(5 * t + j) for t in range(4) for j in range(3)}
    reference = dict(zip(expected, clean_run(llm, list(expected.values()), params)))
    start = threading.Barrier(5)
    errors = []

    def producer(t):
        try:
            start.wait()
            for j in range(3):
                engine.add_request(f"t{t}-{j}", expected[f"t{t}-{j}"], params)
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    start.wait()
    results = {}
    while any(th.is_alive() for th in threads) or engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in results
            results[out.request_id] = out
    for th in threads:
        th.join()
    assert not errors
    assert set(results) == set(expected)
    for rid, out in results.items():
        assert out.prompt_token_ids == expected[rid]["prompt_token_ids"]
        assert out.outputs[0].token_ids == reference[rid]
        assert out.outputs[0].finish_reason == "length"


def test_add_request_does_not_wait_for_a_running_step(llm, engine, monkeypatch):
    """Adding from another thread takes effect while a step is still computing (the worker
    submits hundreds of requests per shard; each must not wait for a step)."""
    in_step, release = threading.Event(), threading.Event()
    execute = engine.runner.execute

    def slow_execute(batch):
        in_step.set()
        assert release.wait(30)
        return execute(batch)

    monkeypatch.setattr(engine.runner, "execute", slow_execute)
    engine.add_request("first", prompt(1), greedy(2))
    stepper = threading.Thread(target=engine.step)
    stepper.start()
    assert in_step.wait(30)
    added = threading.Event()
    adder = threading.Thread(target=lambda: (engine.add_request("second", prompt(2), greedy(2)), added.set()))
    adder.start()
    assert added.wait(10), "add_request blocked behind the running step"
    assert engine.num_unfinished_requests == 2
    release.set()
    stepper.join()
    monkeypatch.setattr(engine.runner, "execute", execute)
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step()}
    assert finished == {"first", "second"}


def test_preemption_and_chunked_prefill_do_not_change_outputs(llm, model_dir):
    """A pool too small for all requests at once (so sequences are preempted and
    recomputed) and a tiny token budget (so prompts are chunked) give the same tokens,
    seeded samples and logprobs as a roomy engine."""
    prompts = [prompt(80 + i, length=20) for i in range(4)]
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True, logprobs=2)
    params = [greedy(30), seeded] * 2
    roomy = [o.outputs[0] for o in llm.generate(prompts, params)]
    tight = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=6, max_num_batched_tokens=12)
    outs = [o.outputs[0] for o in tight.generate(prompts, params)]
    assert tight.llm_engine.stats["preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    for a, b in zip(roomy[1::2], outs[1::2]):
        assert [sorted(e) for e in a.logprobs] == [sorted(e) for e in b.logprobs]
        for ea, eb in zip(a.logprobs, b.logprobs):
            assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 and ea[t].rank == eb[t].rank for t in ea)
    assert_pool_free(tight.llm_engine)


# ---- aborts ---------------------------------------------------------------------------


def test_abort_running_request_frees_its_blocks_at_once(llm, engine):
    params = greedy(24)
    prompts = [prompt(i, length=20) for i in range(3)]
    reference = clean_run(llm, prompts, params)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, params)
    for _ in range(3):
        assert engine.step() == []
    victim = engine.requests["a1"].seqs[0]
    held = len(victim.block_table)
    assert held >= 2 and victim.num_output_tokens > 0
    free_before = engine.num_free_blocks()
    assert engine.abort_request("a1") is True
    assert engine.num_free_blocks() == free_before + held
    assert engine.abort_request("a1") is False  # already gone
    assert engine.abort_request("no-such-request") is False
    results = drain(engine)
    assert set(results) == {"a0", "a2"}
    assert results["a0"].outputs[0].token_ids == reference[0]
    assert results["a2"].outputs[0].token_ids == reference[2]


def test_abort_queued_and_waiting_requests(llm, engine):
    params = greedy(5)
    prompts = [prompt(40 + i) for i in range(10)]
    reference = clean_run(llm, prompts, params)
    for i, p in enumerate(prompts):
        engine.add_request(f"w{i}", p, params)
    assert engine.abort_request("w0") is True  # still in the incoming queue
    engine.step()
    # max_num_seqs is 8: of the nine left, the last one is still waiting to be admitted.
    waiting = engine.requests["w9"].seqs[0]
    assert waiting in engine.scheduler.waiting
    assert engine.abort_request("w9") is True
    assert waiting not in engine.scheduler.waiting
    results = drain(engine)
    assert set(results) == {f"w{i}" for i in range(1, 9)}
    for i in range(1, 9):
        assert results[f"w{i}"].outputs[0].token_ids == reference[i]


def test_abort_of_a_request_with_n_sequences(engine):
    engine.add_request("multi", prompt(3), SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=20))
    engine.add_request("other", prompt(4), greedy(3))
    engine.step()
    engine.step()
    assert engine.abort_request("multi") is True
    assert set(drain(engine)) == {"other"}


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("dup", prompt(1), greedy(3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", prompt(2), greedy(3))
    engine.step()  # now it is running, no longer queued
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", prompt(2), greedy(3))
    first = drain(engine)
    assert first["dup"].prompt_token_ids == prompt(1)["prompt_token_ids"]
    # Once finished, the id may be used again.
    engine.add_request("dup", prompt(2), greedy(3))
    assert drain(engine)["dup"].prompt_token_ids == prompt(2)["prompt_token_ids"]


# ---- bad input ------------------------------------------------------------------------

BAD_PROMPTS = [
    ("", "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, VOCAB]}, f"Token id {VOCAB} is out of vocabulary"),
    ({"prompt_token_ids": [-1, 5]}, "Token id -1 is out of vocabulary"),
    ({"prompt_token_ids": [5] * 1024}, r"\(length 1024\) plus .* maximum model length of 1024"),  # its context: 1024
    ({"prompt_token_ids": [5] * 1025}, r"\(length 1025\) is longer than the maximum model length of 1024"),
    ({"prompt_token_ids": [5] * 800}, "KV blocks"),  # fits the context, not the 48-block pool
    ({"prompt_token_ids": "12 13"}, "list of integers"),
    ({"prompt_token_ids": [1, 2.5]}, "list of integers"),
    (123, "prompt"),
    ({"text": "hi"}, "prompt"),
]

BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(n=0), "n must be"),
    (dict(top_p=0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=5, max_tokens=3), "min_tokens"),
    (dict(logprobs=-2), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(seed="7"), "seed"),  # would otherwise fail inside step(), taking every request down
    (dict(seed=1.5), "seed"),
    (dict(seed=2**64), "seed"),
]


def test_bad_input_is_rejected_and_the_engine_keeps_serving(llm, engine):
    params = greedy(10)
    good = [prompt(60 + i, length=10) for i in range(3)]
    reference = clean_run(llm, good, params)
    for i, p in enumerate(good):
        engine.add_request(f"g{i}", p, params)
    engine.step()
    engine.step()
    for j, (bad, message) in enumerate(BAD_PROMPTS):
        with pytest.raises(ValueError, match=message):
            engine.add_request(f"bad-prompt-{j}", bad, greedy(4))
    for j, (kwargs, message) in enumerate(BAD_PARAMS):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
        # The engine checks params itself too (they may have been changed after construction).
        p = SamplingParams()
        for key, value in kwargs.items():
            setattr(p, key, value)
        with pytest.raises(ValueError, match=message):
            engine.add_request(f"bad-params-{j}", prompt(1), p)
    with pytest.raises(ValueError, match="at most 20"):  # above the engine's max_logprobs
        engine.add_request("many-logprobs", prompt(1), SamplingParams(logprobs=50))
    with pytest.raises(TypeError, match="temprature"):  # a misspelt option is an error, not ignored
        SamplingParams(temprature=0.5)
    with pytest.raises(TypeError, match="max_token"):
        engine.add_request("bad-kwarg", prompt(1), greedy(4), max_token=3)
    assert set(engine.requests) | {r.request_id for r in engine._incoming} == {"g0", "g1", "g2"}
    results = drain(engine)
    assert set(results) == {"g0", "g1", "g2"}
    assert [results[f"g{i}"].outputs[0].token_ids for i in range(3)] == reference


def test_generate_with_one_bad_prompt_runs_nothing(llm, engine):
    with pytest.raises(ValueError, match=r"^prompt 2: .*empty"):
        llm.generate([prompt(1), "Hello", "", prompt(2)], greedy(4))
    assert_pool_free(engine)
    bad = SamplingParams()
    bad.temperature = -1
    with pytest.raises(ValueError, match=r"^prompt 1: temperature"):
        llm.generate([prompt(1), prompt(2)], [greedy(4), bad])
    assert_pool_free(engine)
    with pytest.raises(ValueError, match=r"prompts \(3\) and sampling_params \(2\) must be the same"):
        llm.generate([prompt(1), prompt(2), prompt(3)], [greedy(4), greedy(4)])
    assert_pool_free(engine)
    # The LLM is still usable and gives what a fresh run gives.
    outs = llm.generate([prompt(1), prompt(2)], greedy(4))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_generate_interrupted_midway_leaves_nothing_behind(llm, engine, monkeypatch):
    real_step = engine.step
    calls = 0

    def failing_step():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt(i) for i in range(4)], greedy(8))
    monkeypatch.undo()
    assert calls == 3
    assert_pool_free(engine)


def test_context_limit_with_max_model_len(model_dir):
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=24, max_model_len=128)
    engine = llm.llm_engine
    assert engine.max_model_len == 128
    with pytest.raises(ValueError, match="maximum model length of 128"):
        llm.generate({"prompt_token_ids": [7] * 128}, greedy(1))
    assert_pool_free(engine)
    # max_tokens=None runs up to the context; a larger max_tokens is cut there too.
    outs = llm.generate(
        [{"prompt_token_ids": [7] * 127}, {"prompt_token_ids": [9] * 124}, {"prompt_token_ids": [11] * 120}],
        [
            SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
        ],
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 4, 8]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_pool_free(engine)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        LLM(str(model_dir), device="cpu", num_kv_blocks=4, max_model_len=2048)


# ---- bad model directories -----------------------------------------------------------


def test_unknown_architecture_is_a_clear_error(model_dir, tmp_path):
    path = tmp_path / "gpt2"
    shutil.copytree(model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(path), device="cpu", num_kv_blocks=4)


def test_model_dir_without_weights_is_a_clear_error(model_dir, tmp_path):
    path = tmp_path / "no_weights"
    shutil.copytree(model_dir, path, ignore=shutil.ignore_patterns("*.safetensors"))
    assert not list(path.glob("*.safetensors"))
    with pytest.raises(ValueError, match="no safetensors weights"):
        LLM(str(path), device="cpu", num_kv_blocks=4)


def test_model_dir_without_config_is_a_clear_error(model_dir, tmp_path):
    path = tmp_path / "no_config"
    shutil.copytree(model_dir, path, ignore=shutil.ignore_patterns("config.json"))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(path), device="cpu", num_kv_blocks=4)


def test_checkpoint_with_missing_tensor_is_a_clear_error(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "partial"
    shutil.copytree(model_dir, path)
    weights = load_file(str(path / "model.safetensors"))
    name = next(k for k in weights if k.endswith("down_proj.weight"))
    del weights[name]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights"):
        LLM(str(path), device="cpu", num_kv_blocks=4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_size=3), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(num_kv_blocks=0), "num_kv_blocks"),
        (dict(dtype="int8"), "dtype"),
    ],
)
def test_bad_engine_options_are_clear_errors(model_dir, kwargs, message):
    options = dict(device="cpu", num_kv_blocks=4) | kwargs
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), **options)
