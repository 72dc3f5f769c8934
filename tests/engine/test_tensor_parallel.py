"""Tensor parallelism (engine/parallel): each rank's checkpoint slices put back together are the whole
checkpoint, what cannot be split is refused, and, with two gloo ranks as two processes on this machine,
greedy float32 output equals the single-process engine's token for token (Llama, Qwen3, Qwen2-MoE with
its shared expert; chunked prefill, prefix-cache hits and preemption), each rank holds about half the
weights, and a rank that dies ends the engine with a clear error."""

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from engine import LLM, BeamSearchParams, SamplingParams
from engine.entrypoints.llm_args import engine_kwargs
from engine.hf.config import ModelConfig
from engine.parallel.group import TensorParallelError, free_port
from engine.parallel.launch import tensor_parallel_runner
from engine.parallel.runner import weight_bytes
from engine.parallel.sharding import ShardReader, check_shardable, local_config
from tests.helpers import assert_pool_free, make_prompts


def _shards(path, world: int) -> list[dict[str, torch.Tensor]]:
    cfg = ModelConfig.load(path)
    out = []
    for rank in range(world):
        reader = ShardReader(cfg, rank, world)
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            out.append({name: reader(f, name, name) for name in f.keys()})  # noqa: SIM118
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        full = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return cfg, full, out


def test_rank_slices_put_together_are_the_checkpoint(tiny_model):
    """Qwen2 (q/k/v biases) with a vocabulary of 511 (padded to 512) split in two: heads and gate/up
    by rows, o_proj and down_proj by columns, the vocabulary by rows, norms whole on every rank."""
    path = tiny_model("qwen2", vocab_size=511)
    cfg, full, (r0, r1) = _shards(path, 2)
    for name, tensor in full.items():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            assert r0[name].shape[0] == r1[name].shape[0] == 256
            torch.testing.assert_close(torch.cat([r0[name], r1[name]])[:511], tensor, rtol=0, atol=0)
            assert not r1[name][255:].any()  # the padding row
        elif any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            assert r0[name].shape[0] * 2 == tensor.shape[0]
            torch.testing.assert_close(torch.cat([r0[name], r1[name]]), tensor, rtol=0, atol=0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.testing.assert_close(torch.cat([r0[name], r1[name]], dim=1), tensor, rtol=0, atol=0)
        else:
            assert torch.equal(r0[name], tensor) and torch.equal(r1[name], tensor), name
    assert local_config(cfg, 2).vocab_size == 256 and local_config(cfg, 2).num_kv_heads == 1


def test_fewer_kv_heads_than_ranks_replicates_the_head_each_rank_uses(tiny_model):
    path = tiny_model("llama", num_key_value_heads=1)
    _, full, (r0, r1) = _shards(path, 2)
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(r0[k], full[k]) and torch.equal(r1[k], full[k])
    path = tiny_model("llama", num_attention_heads=8, num_key_value_heads=2)  # 4 ranks: heads 0,0,1,1
    cfg = ModelConfig.load(path)
    rows = [ShardReader(cfg, rank, 4).kv for rank in range(4)]
    d = cfg.head_dim
    assert rows == [(0, d), (0, d), (d, d), (d, d)]


def test_expert_columns_split_per_rank(tiny_model):
    """Qwen2-MoE: every expert's and the shared expert's gate/up rows and down columns split in two;
    the router and the shared expert's gate whole."""
    path = tiny_model("qwen2_moe")
    _, full, (r0, r1) = _shards(path, 2)
    for name, tensor in full.items():
        if ".mlp.experts." in name or ".shared_expert." in name:
            dim = 1 if "down_proj" in name else 0
            torch.testing.assert_close(torch.cat([r0[name], r1[name]], dim=dim), tensor, rtol=0, atol=0)
            assert r0[name].shape[dim] * 2 == tensor.shape[dim]
        elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            assert torch.equal(r0[name], tensor) and torch.equal(r1[name], tensor)


def test_what_cannot_be_split_is_refused(tiny_model):
    cfg = ModelConfig.load(tiny_model("llama"))
    with pytest.raises(ValueError, match="4 attention heads do not divide among 3 ranks"):
        check_shardable(cfg, 3)
    with pytest.raises(ValueError, match="OLMo 2"):
        check_shardable(ModelConfig.load(tiny_model("olmo2")), 2)
    with pytest.raises(ValueError, match="encoder models"):
        tensor_parallel_runner(encoder=True, pooling=False)
    with pytest.raises(ValueError, match="pooling runner"):
        tensor_parallel_runner(encoder=False, pooling=True)
    assert engine_kwargs({"tensor_parallel_size": 2}) == {"tensor_parallel_size": 2}
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(str(tiny_model("llama")), tensor_parallel_size=0)


# ---- two ranks, two processes ------------------------------------------------------------------


@contextlib.contextmanager
def _tp_llm(path, **kwargs):
    llm = LLM(str(path), tensor_parallel_size=2, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.runner.close()


def _greedy(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return outs, [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2_moe"])
def test_two_ranks_match_one_token_for_token(tiny_model, arch):
    """A 32-token budget (chunked prefill) and a pool too small for the batch (preemption); the second
    pass reads the shared prefixes from the cache."""
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=3, count=8, shared_prefixes=True)
    settings = dict(num_kv_blocks=30, max_num_batched_tokens=32)
    single = LLM(str(path), **settings)
    expected = [_greedy(single, prompts, max_tokens)[1] for _ in range(2)]
    with _tp_llm(path, async_scheduling=True, **settings) as llm:
        assert not llm.llm_engine.async_scheduling  # the ranks step synchronously (engine/core/async_steps.py)
        first, ours = _greedy(llm, prompts, max_tokens)
        assert ours == expected[0]
        again, ours = _greedy(llm, prompts, max_tokens)
        assert ours == expected[1]
        engine = llm.llm_engine
        assert engine.stats["preemptions"] > 0
        assert sum(o.num_cached_tokens for o in first + again) > 0
        assert_pool_free(engine)
        with pytest.raises(ValueError, match="prompt_logprobs is not supported"):
            llm.generate("hello", SamplingParams(prompt_logprobs=1))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "phi3", "granite", "mixtral"])
def test_other_families_match(tiny_model, arch):
    """Soft caps and tied embeddings (Gemma 2), fused QKV and gate/up checkpoints with partial rotary
    (Phi-3), multipliers (Granite), Mixtral's expert layout."""
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=6, count=4)
    expected = _greedy(LLM(str(path), num_kv_blocks=64), prompts, max_tokens)[1]
    with _tp_llm(path, num_kv_blocks=64) as llm:
        assert _greedy(llm, prompts, max_tokens)[1] == expected


@pytest.mark.slow
def test_each_rank_holds_about_half_the_weights(tiny_model):
    path = tiny_model("llama")
    single = weight_bytes(LLM(str(path), num_kv_blocks=8).llm_engine.runner.model)
    with _tp_llm(path, num_kv_blocks=8) as llm:
        per_rank = llm.llm_engine.runner.weight_bytes_per_rank()
    assert len(per_rank) == 2
    for rank_bytes in per_rank:
        assert rank_bytes <= 0.6 * single, (per_rank, single)


@pytest.mark.slow
def test_a_dead_rank_ends_the_engine_with_a_clear_error(tiny_model):
    path = tiny_model("llama")
    with _tp_llm(path, num_kv_blocks=64) as llm:
        children = subprocess.run(
            ["pgrep", "-P", str(os.getpid()), "-f", "engine.parallel.rank_main"], capture_output=True, text=True
        ).stdout.split()
        assert len(children) == 1
        os.kill(int(children[0]), signal.SIGKILL)
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with status -9"):
            llm.generate([{"prompt_token_ids": [5] * 10}] * 2, params)
        with pytest.raises(TensorParallelError, match="broken"):  # and every later step
            llm.llm_engine.runner.execute(None)


@pytest.mark.slow
def test_ranks_joined_from_the_standard_environment(tiny_model, monkeypatch):
    """Multi-host style: rank 1 started by hand with MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK (here on
    loopback), rank 0 the engine joining the same group; stopped, rank 1 exits 0."""
    path = tiny_model("qwen3")
    prompts, max_tokens = make_prompts(seed=4, count=4)
    settings = dict(num_kv_blocks=64, max_num_batched_tokens=64)
    expected = _greedy(LLM(str(path), **settings), prompts, max_tokens)[1]
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    rank1 = subprocess.Popen(
        [sys.executable, "-m", "engine.parallel.rank_main", "--model", str(path), "--options", json.dumps(settings)],
        env={**os.environ, **env, "RANK": "1"},
    )
    try:
        for name, value in {**env, "RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        with _tp_llm(path, **settings) as llm:
            assert _greedy(llm, prompts, max_tokens)[1] == expected
        assert rank1.wait(timeout=60) == 0
    finally:
        if rank1.poll() is None:
            rank1.kill()


@pytest.mark.slow
def test_beam_search_copies_blocks_on_every_rank(tiny_model):
    """Beams fork and copy their partial block (copy_blocks, broadcast to every rank): same beams as one rank."""
    path = tiny_model("llama")
    prompts = [{"prompt_token_ids": p} for p in make_prompts(seed=5)[0][1:4]]  # 15, 16 and 17 tokens
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)

    def beams(llm):
        return [[s.tokens for s in o.sequences] for o in llm.beam_search(prompts, params)]

    expected = beams(LLM(str(path), num_kv_blocks=128, block_size=4))
    with _tp_llm(path, num_kv_blocks=128, block_size=4) as llm:
        assert beams(llm) == expected
