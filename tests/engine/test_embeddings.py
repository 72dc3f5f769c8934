"""The pooling runner: LLM.embed equals sentence-transformers' encode and plain transformers with
the same pooling, through chunked prefill, prefix caching and preemption; errors name themselves."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.params.pooling_params import PoolingParams
from engine.testing.tiny_embedding import write_tiny_embedding_model
from tests.helpers import assert_pool_free

ARCHS = ["llama", "qwen2", "qwen3"]
POOLINGS = ["last", "mean", "cls"]

_WORDS = [
    "paged",
    "attention",
    "stores",
    "the",
    "key",
    "value",
    "cache",
    "in",
    "fixed",
    "size",
    "blocks",
    "hello",
    "world",
    "quick",
    "brown",
    "fox",
]


def texts(seed: int, count: int = 8, shared_prefix: str = "") -> list[str]:
    """Inputs of mixed lengths (a few tokens to ~250), some longer than the chunk budget."""
    rng = random.Random(seed)
    lengths = [1, 3, 60, 120] + [rng.randint(1, 120) for _ in range(count - 4)]
    return [shared_prefix + " ".join(rng.choice(_WORDS) for _ in range(n)) for n in lengths]


def cosines(got, ref) -> np.ndarray:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)


def assert_close(got, ref) -> None:
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape
    assert cosines(got, ref).min() >= 0.99999


def st_encode(path, inputs, **kwargs):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
    return model.encode(inputs, convert_to_numpy=True, **kwargs)


def embed(llm, inputs, **kwargs):
    return [o.outputs.embedding for o in llm.embed(inputs, use_tqdm=False, **kwargs)]


@pytest.fixture(scope="session")
def embedding_model(tmp_path_factory):
    made = {}

    def make(arch: str = "qwen3", pooling: str = "last", **kwargs):
        key = (arch, pooling, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in made:
            made[key] = write_tiny_embedding_model(
                tmp_path_factory.mktemp(f"emb-{arch}-{pooling}"), arch, pooling, **kwargs
            )
        return made[key]

    return make


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_embed_matches_sentence_transformers_chunked_and_cached(embedding_model, arch, pooling):
    path = embedding_model(arch, pooling)
    first = texts(seed=1)
    # shares the long inputs' prefixes (whole blocks of them) with the first call's cached blocks
    second = [t + " and then some more words" for t in first[2:4]] + texts(seed=2, count=4)
    expected = st_encode(path, first + second)
    llm = LLM(str(path), max_num_batched_tokens=32, num_kv_blocks=256, block_size=16)
    assert llm.llm_engine.config.runner == "pooling"  # detected from modules.json
    got = embed(llm, first)
    got += [o.outputs.embedding for o in llm.embed(second, use_tqdm=False)]
    assert_close(got, expected)
    assert llm.llm_engine.stats["steps"] > 10  # long inputs ran in chunks of 32 tokens
    assert_pool_free(llm.llm_engine)
    again = llm.encode(second[:2], use_tqdm=False)
    assert_close([o.outputs.data.numpy() for o in again], expected[len(first) : len(first) + 2])
    cached = [o.num_cached_tokens for o in again]
    if pooling == "last":
        assert min(cached) > 0  # the prefix came from the cache
    else:
        assert cached == [0, 0]  # mean/CLS read every token's hidden state: no prefix hits


@pytest.mark.parametrize("pooling", POOLINGS)
def test_embed_matches_plain_transformers(embedding_model, pooling):
    from transformers import AutoModel

    path = embedding_model("qwen2", pooling, normalize=False)
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 17, 90, 200)]
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            expected.append({"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling].numpy())
    llm = LLM(str(path), max_num_batched_tokens=48, num_kv_blocks=64)
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    got = np.stack([o.outputs.data.numpy() for o in outs])
    assert_close(got, np.stack(expected))
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(expected, axis=1), rtol=1e-4)


def test_st_directory_with_lm_head_generates_too_and_pooling_survives_preemption(embedding_model):
    """A sentence-transformers directory that kept its LM head embeds and generates in one engine:
    decodes growing in a tight pool preempt pooling requests mid-prefill (pure prefill never
    preempts: the oldest request takes the step's budget and finishes), and each result equals
    what it is alone (sentence-transformers' vector; the greedy tokens)."""
    path = embedding_model("qwen3", "mean", with_lm_head=True)
    rng = random.Random(5)
    gen_prompts = [[rng.randrange(512) for _ in range(n)] for n in (9, 40, 20)]
    inputs = texts(seed=5, count=6)
    expected = st_encode(path, inputs)
    llm = LLM(str(path), max_num_batched_tokens=40, num_kv_blocks=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    alone = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in gen_prompts], greedy, use_tqdm=False)
    ]
    engine = llm.llm_engine
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"g{i}", {"prompt_token_ids": p}, greedy)
    for i, text in enumerate(inputs):
        engine.add_pooling_request(f"e{i}", text)
    outs, pooled_seqs = {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        pooled_seqs |= {s for s in engine.scheduler.running + list(engine.scheduler.waiting) if s.pooling}
    assert any(s.num_preemptions for s in pooled_seqs)  # a pooling request was preempted and recomputed
    assert [outs[f"g{i}"].outputs[0].token_ids for i in range(3)] == alone
    assert_close([outs[f"e{i}"].outputs.data.numpy() for i in range(6)], expected)
    assert_pool_free(engine)


def test_embeddings_and_generation_share_steps(tiny_model):
    """A causal LM run as a pooling model still generates; both kinds batch together and each
    equals what it is alone (the last layer's normed hidden state; greedy tokens)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("qwen3")
    rng = random.Random(5)
    embed_prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 70, 130)]
    gen_prompts = [[rng.randrange(512) for _ in range(n)] for n in (9, 40)]
    llm = LLM(str(path), runner="pooling", max_num_batched_tokens=40, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in gen_prompts], greedy, use_tqdm=False)
    ]
    engine = llm.llm_engine
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"g{i}", {"prompt_token_ids": p}, greedy)
    for i, p in enumerate(embed_prompts):
        engine.add_pooling_request(f"e{i}", {"prompt_token_ids": p}, PoolingParams(normalize=False))
    outs, mixed_steps = {}, 0
    while engine.has_unfinished_requests():
        kinds = {s.pooling is None for s in engine.scheduler.running}
        for out in engine.step():
            outs[out.request_id] = out
        mixed_steps += kinds == {True, False}
    assert mixed_steps > 0
    assert [outs[f"g{i}"].outputs[0].token_ids for i in range(2)] == alone
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [
            model(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0, -1].numpy() for p in embed_prompts
        ]
    assert_close([outs[f"e{i}"].outputs.data.numpy() for i in range(3)], expected)
    assert_pool_free(engine)


def test_default_prompt_and_new_sentence_transformers_format(embedding_model, tmp_path):
    """A default prompt is put before every text input, as sentence-transformers does; a directory
    saved by sentence-transformers itself (its current file format) loads the same."""
    from sentence_transformers import SentenceTransformer

    path = embedding_model("qwen3", "mean", default_prompt="Instruct: find the passage\nQuery: ")
    inputs = texts(seed=6, count=5)
    expected = st_encode(path, inputs)
    assert_close(embed(LLM(str(path), num_kv_blocks=64), inputs), expected)
    resaved = tmp_path / "resaved"
    SentenceTransformer(str(path), device="cpu", local_files_only=True).save(str(resaved))
    assert "pooling_mode" in json.loads((resaved / "1_Pooling" / "config.json").read_text())
    assert_close(embed(LLM(str(resaved), num_kv_blocks=64), inputs), expected)


def test_matryoshka_dimensions_truncate_then_renormalize(embedding_model):
    path = embedding_model("qwen3", "last", matryoshka_dimensions=[16, 32, 64])
    inputs = texts(seed=7, count=4)
    full = st_encode(path, inputs)
    llm = LLM(str(path), num_kv_blocks=64)
    got = np.array(embed(llm, inputs, pooling_params=PoolingParams(dimensions=16)))
    assert got.shape == (4, 16)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    assert_close(got, full[:, :16])
    with pytest.raises(ValueError, match="not one of the model's Matryoshka sizes"):
        llm.embed(inputs, pooling_params=PoolingParams(dimensions=20), use_tqdm=False)
    plain = LLM(str(embedding_model("qwen3", "last")), num_kv_blocks=16)
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        plain.embed("hello", pooling_params=PoolingParams(dimensions=16), use_tqdm=False)


def test_truncate_prompt_tokens_and_too_long_inputs(embedding_model):
    path = embedding_model("llama", "mean")
    llm = LLM(str(path), num_kv_blocks=128, max_model_len=64)
    ids = list(range(10, 110))
    with pytest.raises(ValueError, match="prompt 1: the input has 100 tokens, more than the model's context of 64"):
        llm.embed([{"prompt_token_ids": ids[:5]}, {"prompt_token_ids": ids}], use_tqdm=False)
    assert_pool_free(llm.llm_engine)  # nothing of the batch ran
    (cut,) = embed(llm, [{"prompt_token_ids": ids}], truncate_prompt_tokens=30)  # the first 30, as vLLM pools
    (head,) = embed(llm, [{"prompt_token_ids": ids[:30]}])
    (tail,) = embed(llm, [{"prompt_token_ids": ids[-30:]}])
    assert_close([cut], [head])
    left = PoolingParams(truncate_prompt_tokens=30, truncation_side="left")
    assert_close(embed(llm, [{"prompt_token_ids": ids}], pooling_params=left), [tail])
    assert cosines([cut], [tail])[0] < 0.999  # the two cuts differ


def test_runner_mismatches_are_clear_errors(embedding_model, tiny_model, tmp_path):
    generative = LLM(str(tiny_model("qwen3")), num_kv_blocks=8)
    assert generative.llm_engine.config.runner == "generate"
    with pytest.raises(ValueError, match="runner='pooling'"):
        generative.embed("hello", use_tqdm=False)
    pooling_only = LLM(str(embedding_model("qwen3", "cls")), num_kv_blocks=8)
    with pytest.raises(ValueError, match="no language-model head"):
        pooling_only.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="runner='bogus' is not supported"):
        LLM(str(tiny_model("qwen3")), runner="bogus")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: _merge(d / "config.json", {"is_causal": False}), "bidirectional attention is not supported"),
        (lambda d: _merge(d / "1_Pooling" / "config.json", {"pooling_mode_max_tokens": True}), "not supported"),
        (
            lambda d: (d / "modules.json").write_text(
                json.dumps(
                    json.loads((d / "modules.json").read_text())
                    + [{"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]
                )
            ),
            "modules .* are not supported",
        ),
    ],
)
def test_unsupported_model_directories_are_refused(tmp_path, edit, message):
    path = write_tiny_embedding_model(tmp_path / "m", "qwen3", "mean")
    edit(path)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), num_kv_blocks=8)


def _merge(file, values: dict) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **values}))


def test_cli_tiny_model_embedding(tmp_path, capsys):
    from pagedbatch.cli import main

    path = tmp_path / "emb"
    assert (
        main(["tiny-model", str(path), "--embedding", "--arch", "llama", "--pooling", "cls", "--matryoshka", "16,32"])
        == 0
    )
    assert capsys.readouterr().out.strip() == str(path)
    llm = LLM(str(path), num_kv_blocks=16)
    config = llm.llm_engine.pooler_config
    assert (config.method, config.normalize, config.matryoshka_dimensions) == ("CLS", True, [16, 32])
    inputs = texts(seed=8, count=4)
    assert_close(embed(llm, inputs), st_encode(path, inputs))


def test_abort_frees_a_pooling_request_mid_prefill(embedding_model):
    path = embedding_model("qwen3", "mean")
    llm = LLM(str(path), max_num_batched_tokens=16, num_kv_blocks=32)
    engine = llm.llm_engine
    engine.add_pooling_request("long", {"prompt_token_ids": list(range(1, 200))})
    engine.add_pooling_request("short", "hello world")
    assert engine.step() == []  # 16 of the long input's 199 tokens
    assert engine.num_free_blocks() < engine.block_manager.num_blocks
    assert engine.abort_request("long")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["short"]
    assert_close([outs[0].outputs.data.numpy()], st_encode(path, ["hello world"]))
    assert_pool_free(engine)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_pooling_request("short", "x")
        engine.add_pooling_request("short", "x")


def test_many_inputs_under_one_request_id(embedding_model):
    """A batch line's inputs: one request, one output with the vectors stacked in input order, each
    equal to sentence-transformers'; one bad input refuses the whole request; abort frees them all."""
    path = embedding_model("llama", "last")
    inputs = texts(seed=9, count=6)
    llm = LLM(str(path), max_num_batched_tokens=32, num_kv_blocks=64, max_model_len=200)
    engine = llm.llm_engine
    engine.add_pooling_request("line-1", inputs + [{"prompt_token_ids": [7, 8, 9]}])
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (out,) = outs
    assert out.outputs.data.shape == (7, 64)
    assert out.prompt_token_ids[-1] == [7, 8, 9] and len(out.prompt_token_ids) == 7
    expected = np.vstack([st_encode(path, inputs), embed(llm, [{"prompt_token_ids": [7, 8, 9]}])])
    assert_close(out.outputs.data.numpy(), expected)
    with pytest.raises(ValueError, match="input 1: the input has 300 tokens"):
        engine.add_pooling_request("line-2", [{"prompt_token_ids": [1]}, {"prompt_token_ids": [1] * 300}])
    assert not engine.has_unfinished_requests()
    engine.add_pooling_request("line-3", [{"prompt_token_ids": list(range(1, 150))}] * 3)
    engine.step()
    assert engine.abort_request("line-3")
    assert_pool_free(engine)


def test_vllm_task_embed_means_the_pooling_runner(tiny_model):
    llm = LLM(str(tiny_model("qwen3")), task="embed", num_kv_blocks=8)
    assert llm.llm_engine.config.runner == "pooling"
    assert len(llm.embed("hello", use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="task='classify' is not supported"):
        LLM(str(tiny_model("qwen3")), task="classify", num_kv_blocks=8)


def test_engine_host_runs_pooling_requests_and_fails_generation_on_a_headless_model(embedding_model):
    from engine import LLMEngine
    from workers.host.engine_host import EngineHost

    path = embedding_model("qwen3", "cls")
    inputs = texts(seed=10, count=5)
    host = EngineHost(lambda: LLMEngine(str(path), num_kv_blocks=64, max_num_batched_tokens=32))
    try:
        line = host.submit("line", inputs, PoolingParams())
        one = host.submit("one", inputs[0], PoolingParams())
        chat = host.submit("chat", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4))
        assert_close(line.result(timeout=60).outputs.data.numpy(), st_encode(path, inputs))
        assert_close([one.result(timeout=60).outputs.data.numpy()], st_encode(path, inputs[:1]))
        with pytest.raises(ValueError, match="no language-model head"):
            chat.result(timeout=60)
    finally:
        host.close()


@pytest.mark.parametrize("pooling", POOLINGS)
def test_pooling_only_steps_take_the_lean_forward_and_match_the_generic_one(embedding_model, pooling, monkeypatch):
    """Steps of pooling prompts only run `engine.pooling.forward` (attention on the fresh K/V; the
    last layer on pooled rows only when asked), chunked or not, with prefix caching on or off; its vectors
    equal sentence-transformers' and the generic paged forward's."""
    from engine.pooling import forward as pooling_forward

    path = embedding_model("qwen3", pooling)
    inputs = texts(seed=3)
    expected = st_encode(path, inputs)
    calls = []
    run = pooling_forward.run
    monkeypatch.setattr(pooling_forward, "run", lambda runner, batch: calls.append(1) or run(runner, batch))
    for caching, prune in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(pooling_forward, "PRUNE_LAST_LAYER", prune)
        calls.clear()
        llm = LLM(str(path), max_num_batched_tokens=64, num_kv_blocks=64, enable_prefix_caching=caching)
        lean = embed(llm, inputs)
        assert_close(lean, expected)
        assert len(calls) == llm.llm_engine.stats["steps"] > 3  # every step (chunks of 64 tokens) took it
        assert_pool_free(llm.llm_engine)
    monkeypatch.setattr(pooling_forward, "applies", lambda runner, batch: False)
    calls.clear()
    generic = embed(LLM(str(path), max_num_batched_tokens=64, num_kv_blocks=64), inputs)
    assert not calls
    assert cosines(lean, generic).min() >= 0.99999


@pytest.mark.parametrize("pooling", POOLINGS)
def test_a_vector_does_not_depend_on_its_batch_its_cached_prefix_or_threads(embedding_model, pooling):
    """Bit for bit, an input's vector alone equals its vector among others in any order, after
    part of it was cached, and on another number of intra-op threads (a worker batches lines that
    the offline engine embeds one call at a time, and runs its own threads), tiny inputs included;
    with the GEMMs through oneDNN."""
    path = embedding_model("llama", pooling)
    inputs = ["hi", "a b", "paged attention"] + texts(seed=11, count=10)
    llm = LLM(str(path), num_kv_blocks=256, enable_prefix_caching=False)
    alone = np.asarray([embed(llm, [x])[0] for x in inputs])
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            np.testing.assert_array_equal(np.asarray(embed(llm, inputs)), alone)
            np.testing.assert_array_equal(np.asarray(embed(llm, inputs[::-1])[::-1]), alone)
            cached = LLM(str(path), num_kv_blocks=256, enable_prefix_caching=True)
            embed(cached, [x + " and then a longer tail of words" for x in inputs])
            outs = cached.embed(inputs, use_tqdm=False)
            np.testing.assert_array_equal(np.asarray([o.outputs.embedding for o in outs]), alone)
            if pooling == "last":
                assert sum(o.num_cached_tokens for o in outs) > 100  # continued from cached prefixes
        finally:
            torch.set_num_threads(before)
    assert_close(alone, st_encode(path, inputs))
