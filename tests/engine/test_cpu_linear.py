import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.runner.cpu_linear import PackedLinear, can_pack, pack_linears


def test_the_pinned_torch_can_pack_on_cpu():
    assert can_pack(torch.device("cpu"), torch.float32) and can_pack(torch.device("cpu"), torch.bfloat16)
    assert not can_pack(torch.device("cpu"), torch.float16)


@pytest.mark.parametrize("rows", [1, 3, 64, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear_in_float32(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    expected = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    got = PackedLinear(linear)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 160)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_any_leading_shape_and_strides():
    linear = nn.Linear(32, 48)
    packed = PackedLinear(linear)
    x = torch.randn(4, 10, 64)[..., ::2]  # non-contiguous, three dimensions
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_packed_linear_in_bfloat16_matches_torch_exactly():
    linear = nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    x = torch.randn(17, 64, dtype=torch.bfloat16)
    assert torch.equal(PackedLinear(linear)(x), linear(x))


def test_bfloat16_packs_as_float32_where_onednn_has_no_bfloat16_kernels(monkeypatch):
    from engine.runner import cpu_linear

    monkeypatch.setattr(cpu_linear, "onednn_bf16", lambda: False)
    linear = nn.Linear(64, 96).to(torch.bfloat16)
    x = torch.randn(2, 9, 64, dtype=torch.bfloat16)
    packed = PackedLinear(linear)
    assert packed.packed.dtype == torch.float32
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 9, 96)
    want = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)  # bfloat16 rounding of the output only


def test_packed_rows_do_not_depend_on_their_batch():
    packed = PackedLinear(nn.Linear(128, 256, bias=False))
    x = torch.randn(200, 128)
    whole = packed(x)
    for count in (1, 7, 48):
        assert torch.equal(packed(x[:count]), whole[:count])


def test_pack_linears_replaces_every_linear_and_keeps_a_tied_weight():
    embed = nn.Embedding(50, 16)
    model = nn.ModuleDict({"embed": embed, "a": nn.Linear(16, 16), "head": nn.Linear(16, 50, bias=False)})
    model["head"].weight = embed.weight
    x = torch.randn(5, 16)
    before = model["head"](model["a"](x))
    assert pack_linears(model) == 2
    assert isinstance(model["a"], PackedLinear) and isinstance(model["head"], PackedLinear)
    assert model["embed"].weight is embed.weight
    torch.testing.assert_close(model["head"](model["a"](x)), before, rtol=1e-5, atol=1e-5)


def test_cpu_runner_packs_its_linears(tiny_model):
    from engine import LLM

    llm = LLM(str(tiny_model("llama")), device="cpu")
    model = llm.llm_engine.runner.model
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)


def test_row_counts_are_padded_to_few_sizes_with_little_waste():
    from engine.runner.cpu_linear import row_sizes
    from pagedbatch_kernels.cpu.cpu_prefill import EXACT_ROWS, padded_rows

    assert [padded_rows(n) for n in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))
    previous = 0
    for rows in range(1, 9000):
        padded = padded_rows(rows)
        assert rows <= padded <= rows * 9 / 8 and padded >= previous
        previous = padded
    assert padded_rows(37) == 40 and padded_rows(8192) == 8192 and padded_rows(8193) == 9216
    sizes = row_sizes(8192)
    assert len(sizes) == EXACT_ROWS + 8 * 10 and sizes[-1] == 8192  # eight per doubling from 8 to 8192


def test_a_padded_call_gives_each_row_what_it_gets_alone():
    packed = PackedLinear(nn.Linear(64, 80))
    x = torch.randn(37, 64)  # run as 40 rows
    got = packed(x)
    assert got.shape == (37, 80)
    for i in (0, 20, 36):
        assert torch.equal(got[i], packed(x[i : i + 1])[0])


def test_warming_builds_each_layer_shape_once_per_padded_size():
    from engine.runner.cpu_linear import WARM_ROWS, row_sizes, warm_packed_linears

    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 32), nn.Linear(32, 16, bias=False))
    pack_linears(model)
    assert warm_packed_linears(model, 100) == 3 * len(row_sizes(100))  # (16, 32, bias) twice: one shape
    assert warm_packed_linears(model, 100_000) == 3 * len(row_sizes(WARM_ROWS))


@pytest.mark.parametrize("shape", [(16, 64), (37, 64), (3, 11, 64)])  # exact, padded (to 40), three dimensions
@pytest.mark.parametrize("bf16_as_f32", [False, True])
def test_fused_add_and_gelu_equal_their_plain_twins(shape, bf16_as_f32, monkeypatch):
    from engine.runner import cpu_linear

    dtype = torch.bfloat16 if bf16_as_f32 else torch.float32
    if bf16_as_f32:
        monkeypatch.setattr(cpu_linear, "onednn_bf16", lambda: False)
    torch.manual_seed(len(shape) * 100 + shape[0])
    linear = nn.Linear(64, 48).to(dtype)
    packed = PackedLinear(linear)
    x, residual = torch.randn(*shape, dtype=dtype), torch.randn(*shape[:-1], 48, dtype=dtype)
    plain = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    tolerance = dict(rtol=2e-2, atol=2e-2) if bf16_as_f32 else dict(rtol=1e-5, atol=1e-5)
    for got, want in (
        (packed(x), plain),
        (packed.forward_add(x, residual), residual.float() + plain),
        (packed.forward_gelu(x, "tanh"), F.gelu(plain, approximate="tanh")),
    ):
        assert got.dtype == dtype and got.shape == (*shape[:-1], 48)
        torch.testing.assert_close(got.float(), want, **tolerance)
