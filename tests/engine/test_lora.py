"""Multi-LoRA: greedy float32 output of the base model and of three PEFT adapters (different ranks and
target modules, one rsLoRA), mixed in one `generate` call with prefix caching on, equals PEFT's
`PeftModel` token for token; fewer slots than adapters swap them without a wrong token; bad adapters
and options are refused clearly."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.request import LoRARequest as RequestFromModule
from tests.engine.lora_adapters import peft_reference, write_adapter, write_adapters
from tests.helpers import assert_pool_free


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    return write_adapters(base, tmp_path_factory.mktemp("adapters"))


def _prompts(seed=3, count=6):
    """Prompts sharing long prefixes (two full blocks and more), so that the prefix cache is used."""
    rng = random.Random(seed)
    prefix = [rng.randrange(512) for _ in range(40)]
    prompts = [prefix + [rng.randrange(512) for _ in range(rng.randint(1, 20))] for _ in range(count)]
    return prompts, [rng.randint(4, 12) for _ in prompts]


def _requests(adapters):
    return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(adapters.items(), 1)}


def _mixed_run(llm, adapters, prompts, max_tokens):
    """Every prompt under the base and under each adapter, interleaved, in one generate call."""
    requests = _requests(adapters)
    names = [None, *adapters]
    jobs = [(name, p, n) for p, n in zip(prompts, max_tokens) for name in names]
    outs = llm.generate(
        [{"prompt_token_ids": p} for _, p, _ in jobs],
        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, _, n in jobs],
        lora_request=[requests[name] if name else None for name, _, _ in jobs],
        use_tqdm=False,
    )
    got = {name: [] for name in names}
    for (name, _, _), out in zip(jobs, outs):
        got[name].append(out.outputs[0].token_ids)
    return got


def _expected(base, adapters, prompts, max_tokens):
    expected = {None: peft_reference(base, None, prompts, max_tokens)}
    for name, path in adapters.items():
        expected[name] = peft_reference(base, path, prompts, max_tokens)
    return expected


def test_request_is_importable_both_ways():
    assert LoRARequest is RequestFromModule
    r = LoRARequest("sql", 3, "/x")
    assert (r.adapter_id, r.name, r.path) == (3, "sql", "/x")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("sql", 0, "/x")


def test_adapters_change_the_output(base, adapters):
    prompts, max_tokens = _prompts()
    expected = _expected(base, adapters, prompts, max_tokens)
    for name in adapters:  # otherwise equality with PEFT would prove nothing
        assert expected[name] != expected[None], name


@pytest.mark.parametrize("max_num_batched_tokens", [8192, 24])  # one step per prompt, and chunked prefill
def test_mixed_adapters_match_peft(base, adapters, max_num_batched_tokens):
    prompts, max_tokens = _prompts()
    llm = LLM(
        str(base),
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
        enable_prefix_caching=True,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    first = _mixed_run(llm, adapters, prompts, max_tokens)
    again = _mixed_run(llm, adapters, prompts, max_tokens)  # now from the prefix cache
    assert_pool_free(llm.llm_engine)
    expected = _expected(base, adapters, prompts, max_tokens)
    for name, tokens in expected.items():
        assert first[name] == tokens, f"adapter {name} differs from PEFT"
        assert again[name] == tokens, f"adapter {name} differs from PEFT with cached prefixes"
    assert llm.llm_engine.stats["steps"] < sum(max_tokens) * 4  # one batch, not one run per adapter


@pytest.mark.parametrize("max_loras,max_cpu_loras", [(1, 1), (2, 2)])
def test_fewer_slots_than_adapters_swap_without_a_wrong_token(base, adapters, max_loras, max_cpu_loras):
    prompts, max_tokens = _prompts(seed=5, count=4)
    llm = LLM(
        str(base), enable_lora=True, max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=8, max_num_seqs=6
    )
    runs = [_mixed_run(llm, adapters, prompts, max_tokens) for _ in range(2)]
    assert_pool_free(llm.llm_engine)
    slots = llm.llm_engine.runner.lora
    assert slots.loads > len(adapters)  # adapters were swapped out and back in
    assert len(slots.in_memory) == max_cpu_loras  # the others are read again from their directories
    for got in runs:
        for name, tokens in _expected(base, adapters, prompts, max_tokens).items():
            assert got[name] == tokens, f"adapter {name} differs from PEFT with {max_loras} slot(s)"


def test_one_lora_request_for_every_prompt(base, adapters):
    prompts, max_tokens = _prompts(count=3)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8)
    name = "mlp-o"
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens],
        lora_request=LoRARequest(name, 7, adapters[name]),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == peft_reference(base, adapters[name], prompts, max_tokens)


def test_refusals(base, adapters, tmp_path):
    params = SamplingParams(max_tokens=2)
    plain = LLM(str(base))
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate("hi", params, lora_request=LoRARequest("a", 1, adapters["attn-qv"]))
    llm = LLM(str(base), enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8, above max_lora_rank=4"):
        llm.generate("hi", params, lora_request=LoRARequest("all", 2, adapters["all-rslora"]))
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        llm.generate("hi", params, lora_request=LoRARequest("none", 3, str(tmp_path)))
    llm.generate("hi", params, lora_request=LoRARequest("qv", 4, adapters["attn-qv"]), use_tqdm=False)
    with pytest.raises(ValueError, match="already names adapter 'qv'"):
        llm.generate("hi", params, lora_request=LoRARequest("other", 4, adapters["mlp-o"]))
    with pytest.raises(ValueError, match="lengths of prompts"):
        llm.generate(["a", "b"], params, lora_request=[None])
    embed = write_adapter(base, tmp_path / "embed", r=2, lora_alpha=2, target_modules=["embed_tokens"])
    with pytest.raises(ValueError, match="not on a supported module"):
        llm.generate("hi", params, lora_request=LoRARequest("embed", 5, str(embed)))
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True, "r": 2}))
    with pytest.raises(ValueError, match="DoRA"):
        llm.generate("hi", params, lora_request=LoRARequest("dora", 6, str(dora)))
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(base), enable_lora=True, max_loras=2, max_cpu_loras=1)
    assert_pool_free(llm.llm_engine)


def test_fused_phi3_layers_take_adapters_on_their_parts_and_whole(tiny_model, tmp_path):
    """Phi-3's checkpoints hold qkv_proj and gate_up_proj fused; PEFT adapters on them apply whole."""
    base = tiny_model("phi3")
    path = str(
        write_adapter(
            base,
            tmp_path / "phi",
            r=4,
            lora_alpha=8,
            target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        )
    )
    prompts, max_tokens = _prompts(count=3)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=4)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, lora_request=LoRARequest("phi", 1, path), use_tqdm=False
    )
    expected = peft_reference(base, path, prompts, max_tokens)
    assert expected != peft_reference(base, None, prompts, max_tokens)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_prefix_cache_keeps_adapters_apart(base):
    from engine.core.block_manager import BlockManager
    from engine.core.sequence import Sequence

    bm = BlockManager(8, 4)
    seqs = [Sequence(i, str(i), 0, list(range(8)), SamplingParams()) for i in range(3)]
    seqs[1].lora_id, seqs[2].lora_id = 1, 2
    hashes = {bm.block_hash(s, 1) for s in seqs}
    assert len(hashes) == 3
    assert bm.num_cached_blocks(list(range(8)), lora_id=1) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_triton_delta_matches_its_twin(dtype, tokens):
    from pagedbatch_kernels.lora_quant.lora import add_lora_delta
    from pagedbatch_kernels.lora_quant.lora_reference import lora_delta

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(tokens)
    slots_n, rank, k, n = 3, 12, 80, 72
    a = torch.randn(slots_n + 1, rank, k, generator=gen).to(device, dtype)
    b = torch.randn(slots_n + 1, n, rank, generator=gen).to(device, dtype)
    a[0], b[0] = 0, 0
    x = torch.randn(tokens, k, generator=gen).to(device, dtype)
    slots = torch.randint(0, slots_n + 1, (tokens,), generator=gen).to(device, torch.int32)
    y = torch.randn(tokens, n, generator=gen).to(device, dtype)
    expected = (y.float() + lora_delta(x, a, b, slots).float()).to(dtype)
    base_rows = slots == 0
    got = add_lora_delta(y.clone(), x, a, b, slots)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * 10)
    torch.testing.assert_close(got[base_rows], y[base_rows], rtol=0, atol=0)


# (adapter per sequence, rows per sequence, the path begin_step picks): runs of one adapter (the
# scheduler's grouping, or long prefill chunks in any order) take the per-run path; short interleaved
# runs the masked one.
CPU_STEPS = {
    "grouped-decode": ([0, 0, 1, 1, 2, 3, 3], [1] * 7, "runs"),
    "prefill-chunks": ([1, 0, 2, 3, 1, 2], [20, 9, 17, 16, 20, 2], "runs"),
    "mixed-grouped": ([0, 1, 1, 2, 3], [5, 1, 30, 1, 1], "runs"),
    "interleaved": ([0, 2, 1, 2, 3, 0], [3, 1, 5, 2, 1, 4], "onehot"),
    "interleaved-decode": ([1, 2, 1, 3, 2, 0, 1], [1] * 7, "onehot"),
}


TOLERANCE = 1e-4


@pytest.mark.parametrize("case", CPU_STEPS)
def test_cpu_delta_matches_the_twin(base, adapters, case):
    """The CPU paths (per run of one adapter; every slot at once, masked per row) against the twin, on
    the engine's weights (a fused layer and a plain one; adapters that skip a layer add nothing)."""
    from engine.lora.layers import LoRALinear
    from pagedbatch_kernels.lora_quant.lora_reference import lora_delta

    llm = LLM(str(base), enable_lora=True, max_loras=3, max_lora_rank=8)
    slots = llm.llm_engine.runner.lora
    for request in _requests(adapters).values():
        slots.register(request)
    slots.activate({1, 2, 3})
    per_seq, counts, path = CPU_STEPS[case]
    slots.begin_step(per_seq, counts)
    step = slots._step[0]
    assert getattr(step, path) is not None and (step.runs is None) == (path != "runs")
    rows = torch.repeat_interleave(torch.tensor([slots.slot_of[i] if i else 0 for i in per_seq]), torch.tensor(counts))
    torch.manual_seed(len(counts))
    for module in ("q_proj", "down_proj"):
        layer = slots.layers[(0, module)]
        assert isinstance(layer, LoRALinear)
        x = torch.randn(sum(counts), layer.in_features)
        delta = lora_delta(x, layer.lora_a, layer.lora_b, rows)
        assert delta.abs().max() > 100 * TOLERANCE  # a wrong or missing delta cannot hide in the tolerance
        # float32 sums in another order (oneDNN's AVX-512 kernels on a Xeon): ~1e-5 off on outputs near zero
        torch.testing.assert_close(layer(x), layer.base(x) + delta, rtol=TOLERANCE, atol=TOLERANCE)
    slots.end_step()
    torch.testing.assert_close(layer(x), layer.base(x))


def test_adapter_runs_merge_neighbours_and_skip_the_base():
    from engine.lora.slots import adapter_runs

    assert adapter_runs([0, 2, 2, 1, 0, 1, 1], [3, 4, 1, 2, 5, 1, 0]) == ((2, 3, 8), (1, 8, 10), (1, 15, 16))
    assert adapter_runs([0, 0], [1, 1]) == ()


def test_offline_run_mixes_adapters_by_line_model(base, adapters, tmp_path):
    """`pagedbatch run --lora NAME=DIR`'s path: a line naming an adapter runs with it, one naming no model on
    the base, an unknown name is a line error listing the known ones."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from tests.helpers import jsonl
    from workers.offline import run_offline

    prompts, max_tokens = _prompts(count=2)
    names = [None, *adapters]
    lines = [
        {
            "custom_id": f"{name}/{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                **({"model": name} if name else {}),
                "prompt": p,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i, (p, n) in enumerate(zip(prompts, max_tokens))
        for name in names
    ]
    lines.append(
        {
            "custom_id": "bad",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "nope", "prompt": "hi", "max_tokens": 2},
        }
    )
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    src.write_bytes(jsonl(lines))
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8)
    run_offline(str(src), str(out), base, progress=False, llm=llm, loras=adapters)
    rows = {r["custom_id"]: r for r in pq.read_table(out).to_pylist()}
    assert rows["bad"]["status"] == "failed" and all(n in json.dumps(rows["bad"], default=str) for n in adapters)
    tokenizer = AutoTokenizer.from_pretrained(base)
    for name in names:
        expected = peft_reference(base, adapters.get(name), prompts, max_tokens)
        for i, tokens in enumerate(expected):
            body = json.loads(rows[f"{name}/{i}"]["response_body"])
            assert body["choices"][0]["text"] == tokenizer.decode(tokens, skip_special_tokens=True), (name, i)
