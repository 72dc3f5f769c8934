"""The CPU engine's compiled kernels
(`pagedbatch_kernels.compiled`, `pagedbatch_kernels.cpu.cpu_attention`) against their
plain-torch twins in `pagedbatch_kernels.reference` on random inputs of many shapes, and the eager fallback
where compiling fails."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from pagedbatch_kernels import compiled, reference
from pagedbatch_kernels.cpu import cpu_attention, cpu_decode, cpu_decode_calls, cpu_decode_shortcut, cpu_prefill
from pagedbatch_kernels.cpu.cpu_decode_calls import DecodePlan
from tests.kernels.test_reference import make_batch, naive, with_shared_prefixes

general_plan = functools.partial(cpu_attention.plan_decodes, shortcut=False)

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize(
    "shape",
    [
        ([1], [0]),  # one sequence, one token: the batch and the table are padded to two
        ([1, 1], [15, 16]),  # a context of exactly one block, and one past it
        ([1] * 9, [3, 70, 15, 33, 200, 48, 1, 16, 17]),  # a pure decode step of mixed lengths
        ([1, 1, 40, 9, 1, 23], [70, 15, 0, 48, 16, 17]),  # decodes among prefills and prefix chunks
        ([1, 100, 3, 70], [30, 0, 20, 33]),  # chunks longer than SHORT_CHUNK: cpu_prefill
        ([300, 1, 270], [0, 9, 40]),  # chunks of more than one QUERY_BLOCK
    ],
    ids=["single", "block-edges", "decodes", "mixed", "long-chunks", "query-blocks"],
)
def test_paged_attention_equals_naive(shape, heads, dtype):
    q_lens, ctx_lens = shape
    batch = make_batch(q_lens, ctx_lens, *heads, dtype)
    got = cpu_attention.paged_attention(**batch)
    torch.testing.assert_close(got.double(), naive(**batch), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("head_dim,block_size", [(16, 16), (48, 8), (64, 32), (128, 16)])
def test_decode_kernel_equals_the_reference_decode(head_dim, block_size):
    q_lens, ctx_lens = [1] * 5, [5, 90, 31, 32, 64]
    batch = make_batch(q_lens, ctx_lens, 8, 2, torch.float32, head_dim=head_dim, block_size=block_size, seed=3)
    expected = reference.paged_attention(**batch)
    got = cpu_attention.paged_attention(**batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 37])
def test_pointwise_kernels_equal_the_reference(rows, dtype):
    with compiled.compiling_everything():
        _check_pointwise_kernels(rows, dtype)


def test_small_calls_run_eagerly_and_large_ones_compiled(monkeypatch):
    compiles = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiles.append(fn) or real_compile(fn, **kw))
    kernel = compiled.Compiled(reference.silu_and_mul, eager_below=1000)
    small, large = torch.randn(3, 64), torch.randn(40, 64)
    assert torch.equal(kernel(small), reference.silu_and_mul(small)) and compiles == []
    torch.testing.assert_close(kernel(large), reference.silu_and_mul(large))
    assert compiles == [reference.silu_and_mul]
    with compiled.compiling_everything():
        torch.testing.assert_close(kernel(small), reference.silu_and_mul(small))
    assert not compiled.Compiled.force


def test_bounds_per_dtype_and_an_infinite_one_never_compiles(monkeypatch):
    compiles, smalls = [], []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiles.append(fn) or real_compile(fn, **kw))
    kernel = compiled.Compiled(
        reference.silu_and_mul,
        eager_below={torch.float32: compiled.NATIVE_ALWAYS, None: 1000},
        small=lambda x: smalls.append(x.dtype) or reference.silu_and_mul(x),
    )
    large32, large16 = torch.randn(40, 64), torch.randn(40, 64).bfloat16()
    with compiled.compiling_everything():  # not even the warm-up compiles an infinite bound's calls
        assert torch.equal(kernel(large32), reference.silu_and_mul(large32))
    assert compiles == [] and smalls == [torch.float32]
    torch.testing.assert_close(kernel(large16), reference.silu_and_mul(large16))
    assert compiles == [reference.silu_and_mul] and smalls == [torch.float32]  # bfloat16: the default bound
    kernel(torch.randn(3, 64).bfloat16())
    assert smalls == [torch.float32, torch.bfloat16]


def _check_pointwise_kernels(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    residual = torch.randn(rows, 96, generator=gen).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(compiled.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), **tol)
    got, expected = (
        compiled.fused_add_rms_norm(x, residual, weight, 1e-5),
        reference.fused_add_rms_norm(x, residual, weight, 1e-5),
    )
    torch.testing.assert_close(got, expected, **tol)
    gate_up = torch.randn(rows, 2 * 64, generator=gen).to(dtype)
    torch.testing.assert_close(compiled.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **tol)


def test_a_kernel_that_fails_to_compile_runs_eagerly_with_a_warning(monkeypatch, caplog):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    kernel = compiled.Compiled(reference.silu_and_mul)
    x = torch.randn(3, 8)
    with caplog.at_level(logging.WARNING, logger="pagedbatch_kernels.compiled"):
        assert torch.equal(kernel(x), reference.silu_and_mul(x))
    assert kernel.failed and "no C++ compiler" in caplog.text
    assert torch.equal(kernel(x), reference.silu_and_mul(x))  # and no second attempt


@pytest.mark.parametrize("shared", [False, True], ids=["apart", "shared-prefix"])
def test_the_decode_kernel_falls_back_to_the_reference_decode(monkeypatch, shared):
    kernel = compiled.Compiled(cpu_decode.decode_attention, fallback=cpu_decode._reference_decode)
    kernel.failed = True
    monkeypatch.setattr(cpu_decode, "_decode", kernel)
    batch = make_batch([1] * 7 + [9], [60, 48, 70, 32, 20, 31, 40, 30], 6, 2, torch.float32)
    batch = with_shared_prefixes(batch) if shared else batch
    torch.testing.assert_close(cpu_attention.paged_attention(**batch).double(), naive(**batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
def test_decodes_sharing_prefix_blocks_equal_naive(heads, dtype):
    case = ([1, 1, 1, 1, 1, 1, 1, 9], [60, 48, 70, 32, 20, 31, 40, 30])
    batch = with_shared_prefixes(make_batch(*case, *heads, dtype, seed=4))
    plan = cpu_attention.plan_decodes(batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 16, heads)
    # decodes 0-3 share two blocks (3 is a block short of its token), 4-5 one; the 9-token chunk's
    # rows share their sequence's first block (its rows attend to 31..39 tokens)
    assert sorted(len(blocks) for c in plan.calls for _, _, blocks in c.prefixes) == [1, 1, 2]
    got = cpu_attention.paged_attention(**batch)
    torch.testing.assert_close(got.double(), naive(**batch), atol=TOL[dtype], rtol=TOL[dtype])


def test_small_shared_prefixes_go_whole_through_the_kernel():
    """A group goes apart only where its prefix has the least positions and spares the least reads: decodes
    0-3 share 2 blocks (32 positions, 3 rows x 32 positions spared), 4-5 one block (16, 16 spared)."""
    case = ([1, 1, 1, 1, 1, 1, 1], [60, 48, 70, 40, 20, 31, 40])
    batch = with_shared_prefixes(make_batch(*case, 6, 2, torch.float32, seed=4))
    args = (batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 16, (6, 2), False)
    for sharing, expected in [((1, 16), [1, 2]), ((1, 17), [2]), ((1, 96), [2]), ((1, 97), []), ((17, 0), [2])]:
        for plan in (cpu_attention.plan_decodes(*args, sharing), general_plan(*args, sharing)):
            assert sorted(len(blocks) for c in plan.calls for _, _, blocks in c.prefixes) == expected, sharing
            rows = {r for c in plan.calls for r in (c.tokens.tolist() if c.tokens is not None else range(7))}
            assert rows == set(range(7))  # every decode in some call
    assert not cpu_attention.plan_decodes(*args, (33, 0)).calls[0].prefixes
    got = cpu_attention.paged_attention(**batch)
    torch.testing.assert_close(got.double(), naive(**batch), atol=1e-5, rtol=1e-5)


def test_the_sharing_bounds_follow_the_prefix_matmuls_dtype(monkeypatch):
    monkeypatch.setattr(cpu_attention, "SHARING_BOUNDS", {True: (128, 100), False: (256, 100)})
    pool = torch.empty(4, 16, 2, 64)
    assert cpu_attention.sharing_bounds(pool) == (256, 100)
    bf16 = cpu_prefill.matmul_dtype(torch.bfloat16) == torch.bfloat16
    assert cpu_attention.sharing_bounds(pool.bfloat16()) == ((128, 100) if bf16 else (256, 100))


def test_a_step_is_planned_once_for_all_its_layers_and_again_when_a_buffer_changes(monkeypatch):
    batch = make_batch([1, 1, 1], [40, 3, 17], 6, 2, torch.float32)
    plans = []
    real = cpu_attention.plan_decodes
    monkeypatch.setattr(cpu_attention, "plan_decodes", lambda *a: plans.append(1) or real(*a))
    first = [cpu_attention.paged_attention(**batch) for _ in range(3)]
    assert len(plans) == 1 and all(torch.equal(first[0], o) for o in first)
    batch["seq_lens"].sub_(1)  # a static buffer updated in place for the next step
    torch.testing.assert_close(cpu_attention.paged_attention(**batch).double(), naive(**batch), atol=1e-5, rtol=1e-5)
    assert len(plans) == 2


def test_decodes_of_very_different_lengths_are_split_into_calls():
    assert cpu_attention.width_groups([]) == []
    assert cpu_attention.width_groups([5, 5, 5]) == [[0, 1, 2]]
    groups = cpu_attention.width_groups([1, 2, 30, 31, 3, 32, 8])
    assert sorted(i for g in groups for i in g) == list(range(7)) and len(groups) <= cpu_decode_calls.MAX_GROUPS
    assert [2, 3, 5] in groups and any(set(g) >= {0, 1} for g in groups)
    batch = make_batch([1] * 6, [2, 300, 5, 290, 17, 3], 6, 2, torch.float32)
    plan = cpu_attention.plan_decodes(batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 16, (6, 2))
    assert len(plan.calls) >= 2
    torch.testing.assert_close(cpu_attention.paged_attention(**batch).double(), naive(**batch), atol=1e-5, rtol=1e-5)


LONG_CHUNKS = ([1, 100, 3, 70, 300], [30, 0, 20, 33, 0])  # prompts whole and after a cached prefix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", sorted(cpu_prefill.KERNELS))
def test_both_prompt_kernels_equal_naive(kernel, dtype, monkeypatch):
    monkeypatch.setenv(cpu_prefill.CHOICE_ENV, kernel)
    batch = make_batch(*LONG_CHUNKS, 6, 2, dtype, seed=5)
    got = cpu_attention.paged_attention(**batch)
    torch.testing.assert_close(got.double(), naive(**batch), atol=TOL[dtype], rtol=TOL[dtype])


def test_the_faster_prompt_kernel_is_timed_once_per_shape(monkeypatch):
    monkeypatch.delenv(cpu_prefill.CHOICE_ENV, raising=False)
    monkeypatch.setattr(cpu_prefill, "_choices", {})
    timed = []
    monkeypatch.setattr(cpu_prefill, "calibrate", lambda *key: timed.append(key) or "matmul")
    batch = make_batch(*LONG_CHUNKS, 6, 2, torch.float32, seed=6)
    for _ in range(3):
        got = cpu_attention.paged_attention(**batch)
    shape = (torch.float32, 6, 2, batch["query"].shape[2], batch["k_cache"].shape[1])
    assert timed == [(*shape, "long")]
    torch.testing.assert_close(got.double(), naive(**batch), atol=1e-5, rtol=1e-5)
    many = make_batch([70, 90, 65, 100, 80], [0, 10, 0, 3, 0], 6, 2, torch.float32, seed=7)  # five short prompts
    for _ in range(2):
        got = cpu_attention.paged_attention(**many)
    assert timed == [(*shape, "long"), (*shape, "short")]  # timed apart: a call per prompt weighs more there
    torch.testing.assert_close(got.double(), naive(**many), atol=1e-5, rtol=1e-5)


def test_calibration_names_one_of_the_kernels():
    for kind in ("long", "short"):
        assert cpu_prefill.calibrate(torch.float32, 4, 2, 32, 16, kind, tokens=96, repeats=1) in cpu_prefill.KERNELS


def test_an_unknown_prompt_kernel_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_prefill.CHOICE_ENV, "flash")
    with pytest.raises(ValueError, match=cpu_prefill.CHOICE_ENV):
        cpu_attention.paged_attention(**make_batch(*LONG_CHUNKS, 6, 2, torch.float32))


def test_only_the_varying_sizes_are_symbolic(monkeypatch):
    """A kernel compiles once for every token count, but again for another hidden size (a constant)."""
    graphs = []
    real_compile = torch.compile

    def counting_compile(fn, **kwargs):
        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        return real_compile(fn, backend=backend, **kwargs)

    def norm(x, weight, eps):
        # a function of its own: dynamo remembers, per function, the sizes that changed across its
        # compiles (another test's models) and would make them symbolic from the start
        return reference.rms_norm(x, weight, eps)

    monkeypatch.setattr(torch, "compile", counting_compile)
    kernel = compiled.Compiled(norm)
    weight = torch.randn(48)
    for rows in (5, 9, 33):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(kernel(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    assert len(graphs) == 1
    x, weight = torch.randn(7, 64), torch.randn(64)
    torch.testing.assert_close(kernel(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    assert len(graphs) == 2


@pytest.mark.parametrize(("arch", "dtype"), [("llama", "float32"), ("qwen3", "float32"), ("llama", "bfloat16")])
def test_after_the_warm_up_a_run_compiles_nothing(tiny_model, arch, dtype):
    """Whatever the steps hold (prompts short and long, shared prefixes, decode batches of every
    size), the kernels compiled at load serve them: a compile mid-run would stall it for seconds.
    (bfloat16 batches the shared prefixes' attention: kernels of its own.)"""
    llm = LLM(
        str(tiny_model(arch)),
        device="cpu",
        dtype=dtype,
        enable_prefix_caching=True,
        num_kv_blocks=256,
        max_num_batched_tokens=512,
        attention_backend="compiled",
    )
    before = dict(torch._dynamo.utils.counters["stats"])
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(4, 500, (40,), generator=gen).tolist()
    prompts = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (3, 17, 200, 1, 90)]
    prompts += [system + torch.randint(4, 500, (n,), generator=gen).tolist() for n in (2, 5, 30)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (9, 2, 20, 33, 5, 12, 7, 25)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert dict(torch._dynamo.utils.counters["stats"]) == before


def test_the_cpu_set_names_the_native_rotary_and_no_wrapper_is_compiled_for_nothing():
    """A `Compiled` whose bound is infinite for every dtype never compiles: the CPU set names the kernel it
    would always run (the native rotary) instead of wrapping it."""
    from engine.runner.ops import CPU_OPS
    from pagedbatch_kernels.cpu import cpu_pointwise

    assert CPU_OPS.apply_rotary is cpu_pointwise.apply_rotary
    for name in ("rms_norm", "fused_add_rms_norm", "apply_rotary", "silu_and_mul", "write_kv_cache"):
        kernel = getattr(CPU_OPS, name)
        if isinstance(kernel, compiled.Compiled):
            bounds = kernel.eager_below if isinstance(kernel.eager_below, dict) else {None: kernel.eager_below}
            assert bounds.get(None, 0) != compiled.NATIVE_ALWAYS, f"{name} is wrapped but never compiles"


def _rows_of(plan, block_size=16):
    """Each row of a plan's calls: (its call, the prefix blocks it shares, its own blocks, its length past them)."""
    rows = {}
    for index, call in enumerate(plan.calls):
        assert call.order is None and not call.chunks and call.span_rows is None
        prefix_of = {pos: blocks.tolist() for first, end, blocks in call.prefixes for pos in range(first, end)}
        tokens = range(call.count) if call.tokens is None else call.tokens[: call.count].tolist()
        for pos, row in enumerate(tokens):
            length = int(call.lens[pos])
            own = call.tables[pos, : -(-length // block_size)].tolist()
            rows[row] = (index, call.tables.shape[1], prefix_of.get(pos, []), own, length)
    return rows


def _run(plan, batch):
    out = torch.zeros_like(batch["query"])
    for call in plan.calls:
        call.run(batch["query"], batch["k_cache"], batch["v_cache"], batch["scale"], out)
    return out


def shortcut(tables, lengths, sharing=cpu_attention.SHARE_ANY):
    """The shortcut's plan of a decode step, or None where it stands aside."""
    calls = cpu_decode_shortcut.single_token_calls(tables.numpy(), lengths.numpy().astype(np.int64), None, 16, sharing)
    rows = len(lengths)
    return None if calls is None else DecodePlan(lengths.tolist(), list(range(rows + 1)), calls, [])


def _decode_step(rng, block_size=16):
    """Random decodes over random tables, some groups of rows starting with the same blocks (a shared
    system prompt, a repeated picture, sibling samples), some of them too short to share."""
    rows = int(torch.randint(2, 40, (1,), generator=rng))
    width = 12
    tables = torch.randperm(rows * width + 8, generator=rng)[: rows * width].view(rows, width).int()
    shortest = int(torch.randint(1, 130, (1,), generator=rng))
    lengths = shortest + torch.randint(0, 48, (rows,), generator=rng)
    for _ in range(int(torch.randint(0, 4, (1,), generator=rng))):
        members = torch.randperm(rows, generator=rng)[: int(torch.randint(2, rows + 1, (1,), generator=rng))]
        shared = int(torch.randint(1, 6, (1,), generator=rng))
        tables[members, :shared] = tables[members[0], :shared]
    return tables, lengths.int()


def test_a_decode_step_is_planned_as_the_general_planning_plans_it(monkeypatch):
    """The shortcut for decode steps, with or without shared prefix blocks, gives the general plan's calls,
    or stands aside; the attention it runs matches the naive one."""
    rng = torch.Generator().manual_seed(11)
    taken = shared = 0
    for _ in range(300):
        tables, lengths = _decode_step(rng)
        sharing = [cpu_attention.SHARE_ANY, (32, 64), (64, 512)][int(torch.randint(0, 3, (1,), generator=rng))]
        args = (tables, lengths, torch.arange(len(lengths) + 1, dtype=torch.int32), 16, (6, 2), False, sharing)
        fast = shortcut(tables, lengths, sharing)
        general = general_plan(*args)
        if fast is not None:
            taken += 1
            shared += any(call.prefixes for call in fast.calls)
            assert len(fast.calls) == len(general.calls) and _rows_of(fast) == _rows_of(general)
            if taken % 10 == 1:  # the same attention, bit for bit
                batch = make_batch([1] * len(lengths), (lengths - 1).tolist(), 6, 2, torch.float32, seed=taken)
                pool = (tables.numel() + 8, 16, 2, 32)  # every block id `_decode_step` hands out
                batch |= dict(block_tables=tables, k_cache=torch.randn(pool), v_cache=torch.randn(pool))
                assert torch.equal(_run(fast, batch), _run(general, batch))
    print(f"the shortcut took {taken} of 300 steps, {shared} with shared prefixes")
    assert taken >= 60 and shared >= 20  # (the others split by width)
    batch = with_shared_prefixes(make_batch([1] * 7, [60, 48, 70, 32, 20, 31, 40], 6, 2, torch.float32, seed=4))
    args = (batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 16, (6, 2))
    plan = cpu_attention.plan_decodes(*args)
    assert [(first, end) for first, end, _ in plan.calls[0].prefixes] == [(0, 4), (4, 6)]
    got = cpu_attention.paged_attention(**batch)
    expected = naive(**batch)
    assert (got.double() - expected).abs().max() / expected.abs().max() < 1e-5
    widths = with_shared_prefixes(make_batch([1] * 7, [60, 48, 300, 40, 20, 31, 40], 6, 2, torch.float32))
    tables, lengths = widths["block_tables"], widths["seq_lens"]  # the shared rows' call splits: stands aside
    assert shortcut(tables, lengths) is None
    chunk = make_batch([1, 3, 1], [40, 41, 45], 6, 2, torch.float32)  # a chunk beside two decodes: stands aside
    args = (chunk["block_tables"], chunk["seq_lens"], chunk["query_start_loc"], 16, (6, 2), False, (1, 0))
    assert cpu_attention._shortcut_plan(*args) is None


def test_a_step_sharing_nothing_goes_in_one_call_per_width_group():
    """Or stands aside where the general plan would split a width group again (into parts of one call)."""
    rng = torch.Generator().manual_seed(3)
    taken = 0
    for _ in range(200):
        rows = int(torch.randint(2, 40, (1,), generator=rng))
        lengths = torch.randint(1, int(torch.randint(2, 400, (1,), generator=rng)), (rows,), generator=rng)
        tables = torch.arange(rows * 30, dtype=torch.int32).view(rows, 30)  # distinct first blocks
        plan = shortcut(tables, lengths.int())
        groups = cpu_decode_calls.width_groups([-(-n // 16) for n in lengths.tolist()])
        if plan is None:
            continue
        taken += 1
        assert len(plan.calls) == len(groups) and (plan.calls[0].tokens is None) == (len(groups) == 1)
        assert _rows_of(plan) == _rows_of(general_plan(tables, lengths.int(), torch.arange(rows + 1), 16, (6, 2)))
    assert taken >= 150


def test_the_width_groups_over_arrays_are_the_general_ones():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        widths = rng.integers(1, int(rng.integers(2, 40)), int(rng.integers(1, 60)))
        general = cpu_decode_calls.width_groups(widths.tolist())
        ours = [group.tolist() for group in cpu_decode_shortcut.width_groups(widths)]
        assert ours == (general if len(general) > 1 else [list(range(len(widths)))])


def test_the_decodes_beside_prompt_chunks_take_the_shortcut():
    """A step of decodes and prompt chunks: the decodes' calls over arrays, the chunks' the general way (the long
    one to the prompt kernel); every token in exactly one place, and the attention the naive one."""
    rng = torch.Generator().manual_seed(5)
    for seed in range(6):
        q_lens = [1] * 20 + [3, 17, 100]
        order = torch.randperm(len(q_lens), generator=rng).tolist()
        q_lens = [q_lens[i] for i in order]
        contexts = [60 + int(torch.randint(0, 16, (1,), generator=rng)) if q == 1 else 0 for q in q_lens]
        batch = make_batch(q_lens, [c + (q == 1) * 8 for c, q in zip(contexts, q_lens)], 6, 2, torch.float32, seed=seed)
        decodes = [i for i, q in enumerate(q_lens) if q == 1]
        batch["block_tables"][decodes[1:6], :2] = batch["block_tables"][decodes[0], :2]  # a shared prefix
        args = (batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 16, (6, 2), False, (1, 0))
        assert cpu_attention._shortcut_plan(*args) is not None
        plan = cpu_attention.plan_decodes(*args)
        starts = batch["query_start_loc"].tolist()
        covered = [t for call in plan.calls for t in (call.tokens[: call.count].tolist())]
        covered += [t for i in plan.long_chunks for t in range(starts[i], starts[i + 1])]
        assert sorted(covered) == list(range(starts[-1])) and plan.long_chunks == [q_lens.index(100)]
        assert any(call.prefixes for call in plan.calls)
        got = cpu_attention.paged_attention(**batch)
        expected = naive(**batch)
        assert (got.double() - expected).abs().max() / expected.abs().max() < 1e-5


def test_short_prompt_chunks_go_through_the_shortcut_as_the_general_plan_sends_them():
    """Steps of short prompt chunks (fresh or after a cached context) beside any number of decodes, where the
    native span kernel takes chunks: the shortcut's calls give the general plan's attention bit for bit, or
    it stands aside where a group of chunk rows is worth sharing its blocks."""
    rng = torch.Generator().manual_seed(8)
    sharing, taken = (256, 128), 0
    for case in range(40):
        prompts = int(torch.randint(1, 12, (1,), generator=rng))
        decodes = int(torch.randint(0, 24, (1,), generator=rng))
        q_lens = torch.randint(2, 65, (prompts,), generator=rng).tolist() + [1] * decodes + [80] * (case % 3 == 0)
        order = torch.randperm(len(q_lens), generator=rng).tolist()
        q_lens = [q_lens[i] for i in order]
        contexts = [int(torch.randint(0, 300 if q > 1 else 100, (1,), generator=rng)) for q in q_lens]
        batch = make_batch(q_lens, contexts, 6, 2, torch.float32, seed=case)
        args = (batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 16, (6, 2), True, sharing)
        fast = cpu_attention._shortcut_plan(*args)
        general = general_plan(*args)
        if fast is None:
            continue
        taken += 1
        assert fast.long_chunks == general.long_chunks
        assert torch.equal(_run(fast, batch), _run(general, batch))
        got = cpu_attention.paged_attention(**batch)
        torch.testing.assert_close(got.double(), naive(**batch), atol=1e-5, rtol=1e-5)
    assert taken >= 25
