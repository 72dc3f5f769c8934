"""GPU check of the Triton kernels: accuracy vs the torch twins in bf16, and decode bandwidth.

`check_kernels_on_gpu()` returns (checks, bandwidth):
  checks    list of (kernel, shape, max_rel_err, ok) rows, every kernel on several bf16 shapes;
  bandwidth list of dicts, one per decode-attention microbenchmark: the KV bytes each call
            must read, its time, the achieved GB/s, a torch device-to-device copy's GB/s on the
            same GPU, and their ratio. The headline case is 256 sequences x 1024 context,
            head dim 128, 16 query / 8 kv heads, bf16.

Importable on CPU (torch only at import time); `python -m bench.gpu_kernels` prints both tables.
"""

from __future__ import annotations

import torch

BF16 = torch.bfloat16
ATTN_TOL = 2e-2
POINTWISE_TOL = 1.6e-2


def _rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.float().abs().max().clamp_min(1e-12)
    return ((got.float() - expected.float()).abs().max() / scale).item()


def _paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0, device="cuda"):
    """Random queries over a shuffled paged cache; sequence i has ctx_lens[i] cached + q_lens[i] new."""
    gen = torch.Generator(device=device).manual_seed(seed)
    seq_lens = [c + q for q, c in zip(q_lens, ctx_lens)]
    width = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(q_lens) * width
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return dict(
        query=torch.randn(sum(q_lens), num_heads, head_dim, generator=gen, device=device, dtype=BF16),
        k_cache=torch.randn(shape, generator=gen, device=device, dtype=BF16),
        v_cache=torch.randn(shape, generator=gen, device=device, dtype=BF16),
        block_tables=torch.randperm(num_blocks, generator=gen, device=device).view(len(q_lens), width).int(),
        seq_lens=torch.tensor(seq_lens, device=device, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, device=device, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def _attention_checks(ref, tri):
    gen = torch.Generator().manual_seed(0)
    cases = [
        # (label, q_lens, ctx_lens, heads, head_dim, block_size)
        ("decode ragged", [1] * 64, torch.randint(1, 2048, (64,), generator=gen).tolist(), (32, 8), 128, 16),
        ("decode long", [1] * 4, [16000, 9000, 33, 4097], (16, 8), 128, 16),
        ("prefill", [1024, 333], [0, 0], (32, 32), 128, 16),
        ("chunks+prefix", [512, 129, 1], [2048, 31, 700], (28, 4), 128, 32),
        ("mixed gqa8 d64", [1] * 30 + [256, 17], list(range(40, 3040, 100)) + [100, 0], (16, 2), 64, 16),
        ("mqa d64", [1] * 8 + [300], [1000] * 8 + [16], (8, 1), 64, 32),
    ]
    rows = []
    for label, q_lens, ctx_lens, (h, hkv), d, bs in cases:
        batch = _paged_batch(q_lens, ctx_lens, h, hkv, d, bs)
        expected = ref.paged_attention(**batch)
        shape = f"{label}: seqs={len(q_lens)} tokens={sum(q_lens)} h={h}/{hkv} d={d} bs={bs}"
        for splits in (None, 1, 8):
            err = _rel_err(tri.paged_attention(**batch, num_splits=splits), expected)
            rows.append(("paged_attention", f"{shape} splits={splits or 'auto'}", err, err < ATTN_TOL))
    return rows


def _pointwise_checks(ref, tri):
    rows = []
    dev = "cuda"
    for tokens, hkv, d, bs in [(1000, 8, 128, 16), (77, 2, 64, 32), (4096, 1, 128, 16)]:
        k_cache = torch.randn(512, bs, hkv, d, device=dev, dtype=BF16)
        v_cache = torch.randn_like(k_cache)
        slots = torch.randperm(512 * bs, device=dev)[:tokens]
        slots[::7] = -1
        key = torch.randn(tokens, hkv, d, device=dev, dtype=BF16)
        value = torch.randn_like(key)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        ref.write_kv_cache(key, value, k_ref, v_ref, slots)
        tri.write_kv_cache(key, value, k_cache, v_cache, slots)
        err = max(_rel_err(k_cache, k_ref), _rel_err(v_cache, v_ref))
        rows.append(("write_kv_cache", f"tokens={tokens} hkv={hkv} d={d} bs={bs}", err, err == 0.0))
    for tokens, hidden in [(1, 896), (333, 4096), (4096, 8192)]:
        x = torch.randn(tokens, hidden, device=dev, dtype=BF16)
        res = torch.randn_like(x)
        w = torch.randn(hidden, device=dev, dtype=BF16)
        err = _rel_err(tri.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
        rows.append(("rms_norm", f"{tokens}x{hidden}", err, err < POINTWISE_TOL))
        (n1, r1), (n2, r2) = tri.fused_add_rms_norm(x, res, w, 1e-6), ref.fused_add_rms_norm(x, res, w, 1e-6)
        err = max(_rel_err(n1, n2), _rel_err(r1, r2))
        rows.append(("fused_add_rms_norm", f"{tokens}x{hidden}", err, err < POINTWISE_TOL))
        gate_up = torch.randn(tokens, 2 * hidden, device=dev, dtype=BF16)
        err = _rel_err(tri.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))
        rows.append(("silu_and_mul", f"{tokens}x{2 * hidden}", err, err < POINTWISE_TOL))
    for tokens, h, hkv, d in [(1, 14, 2, 64), (300, 32, 8, 128), (4096, 16, 16, 128)]:
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
        freqs = torch.outer(torch.arange(8192, device=dev).float(), inv_freq)
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        q = torch.randn(tokens, h, d, device=dev, dtype=BF16)
        k = torch.randn(tokens, hkv, d, device=dev, dtype=BF16)
        pos = torch.randint(0, 8192, (tokens,), device=dev)
        (q1, k1), (q2, k2) = tri.apply_rotary(q, k, pos, cos_sin), ref.apply_rotary(q, k, pos, cos_sin)
        err = max(_rel_err(q1, q2), _rel_err(k1, k2))
        rows.append(("apply_rotary", f"tokens={tokens} h={h}/{hkv} d={d}", err, err < POINTWISE_TOL))
    return rows


def _time_ms(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _copy_gbps(num_bytes: int = 1 << 30) -> float:
    src = torch.empty(num_bytes // 2, device="cuda", dtype=BF16).normal_()
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / ms / 1e6  # read + write


def _decode_bandwidth(tri, copy_gbps):
    rows = []
    cases = [  # (label, seqs, context, heads, head_dim)
        ("decode 256x1024 h16/8 d128", 256, 1024, (16, 8), 128),
        ("decode 8x16384 h16/8 d128 (split)", 8, 16384, (16, 8), 128),
    ]
    for label, seqs, context, (h, hkv), d in cases:
        batch = _paged_batch([1] * seqs, [context - 1] * seqs, h, hkv, d, 16, seed=1)
        kv_bytes = 2 * seqs * context * hkv * d * batch["k_cache"].element_size()
        out = torch.empty_like(batch["query"])
        ms = _time_ms(lambda batch=batch, out=out: tri.paged_attention(**batch, out=out, max_query_len=1))
        gbps = kv_bytes / ms / 1e6
        rows.append(
            dict(
                case=label,
                kv_mib=kv_bytes / 2**20,
                ms=ms,
                gbps=gbps,
                copy_gbps=copy_gbps,
                fraction_of_copy=gbps / copy_gbps,
            )
        )
    return rows


def check_kernels_on_gpu():
    """Run every Triton kernel against its torch twin on CUDA in bf16, then time decode attention."""
    if not torch.cuda.is_available():
        raise RuntimeError("check_kernels_on_gpu needs a CUDA device")
    from pagedbatch_kernels import reference as ref
    from pagedbatch_kernels import triton_ops as tri

    torch.manual_seed(0)
    checks = _attention_checks(ref, tri) + _pointwise_checks(ref, tri)
    bandwidth = _decode_bandwidth(tri, _copy_gbps())
    return checks, bandwidth


def print_tables(checks, bandwidth) -> None:
    print(f"{'kernel':<20} {'shape':<78} {'max rel err':>11}  ok")
    for kernel, shape, err, ok in checks:
        print(f"{kernel:<20} {shape:<78} {err:>11.2e}  {'yes' if ok else 'NO'}")
    print()
    print(f"{'decode attention':<36} {'KV MiB':>8} {'ms':>8} {'GB/s':>8} {'copy GB/s':>10} {'of copy':>8}")
    for r in bandwidth:
        print(
            f"{r['case']:<36} {r['kv_mib']:>8.0f} {r['ms']:>8.3f} {r['gbps']:>8.0f} {r['copy_gbps']:>10.0f}"
            f" {r['fraction_of_copy']:>8.0%}"
        )


def main() -> None:
    print_tables(*check_kernels_on_gpu())


if __name__ == "__main__":
    main()
