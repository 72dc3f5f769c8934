"""Sliding windows and soft caps on the GPU, in one command (`python -m bench.gpu_window`):

1. The Triton paged attention with a window and/or a soft cap against the torch twin (CPU, float32), on
   mixed batches (decodes, fresh prefills longer than the window, chunks after a cached prefix), head
   sizes 64/128/256, float32 and bfloat16, flash-decoding splits 1 and 4, and decode-only steps.
2. The engine on CUDA (Triton kernels, CUDA graphs for decodes) in float32 against transformers' eager
   attention on the same GPU, greedy, token for token, for tiny Gemma 2, Gemma 3 and Phi-3 models.
Prints one table; the same checks run on CPU through Triton's interpreter in tests/.
"""

from __future__ import annotations

import random
import tempfile

import torch

from pagedbatch_kernels import reference

CASES = [(None, None), (32, None), (100, None), (None, 50.0), (64, 30.0)]


def _batch(q_lens, ctx, heads, kv_heads, head_dim, block_size, gen):
    seq_lens = [c + q for q, c in zip(q_lens, ctx)]
    width = max(-(-n // block_size) for n in seq_lens) + 1
    blocks = len(q_lens) * width + 3
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return dict(
        query=torch.randn(sum(q_lens), heads, head_dim, generator=gen),
        k_cache=torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen),
        v_cache=torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen),
        block_tables=torch.randperm(blocks, generator=gen)[: len(q_lens) * width].view(len(q_lens), width).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def kernel_rows() -> list[tuple]:
    from pagedbatch_kernels import triton_ops

    gen, rows = torch.Generator().manual_seed(0), []
    mixes = {
        "mixed": ([1, 1, 1, 200, 9, 1, 37, 3], [700, 15, 333, 0, 480, 16, 170, 64]),
        "decode": ([1] * 16, [random.Random(i).randint(1, 2000) for i in range(16)]),
    }
    for head_dim, heads in [(64, (8, 2)), (128, (16, 4)), (256, (8, 4))]:
        for mix, (q_lens, ctx) in mixes.items():
            batch = _batch(q_lens, ctx, *heads, head_dim, 16, gen)
            for window, cap in CASES:
                expected = reference.paged_attention(**batch, window=window, softcap=cap).double()
                for dtype in (torch.float32, torch.bfloat16):
                    gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                    for k in ("query", "k_cache", "v_cache"):
                        gpu[k] = gpu[k].to(dtype)
                    hints = {"max_query_len": 1} if mix == "decode" else {}
                    for splits in (1, 4):
                        got = triton_ops.paged_attention(**gpu, window=window, softcap=cap, num_splits=splits, **hints)
                        err = ((got.double().cpu() - expected).abs().max() / expected.abs().max()).item()
                        ok = err < (1e-4 if dtype == torch.float32 else 3e-2)
                        rows.append(
                            (
                                f"attention d={head_dim} {mix}",
                                f"w={window} cap={cap} {dtype} s={splits}",
                                f"{err:.2e}",
                                ok,
                            )
                        )
    return rows


def engine_rows() -> list[tuple]:
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.testing.tiny import write_tiny_model

    rows, rng = [], random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 17, 40, 130, 300, 64, 1, 222)]
    for arch in ("gemma2", "gemma3", "phi3"):
        path = write_tiny_model(tempfile.mkdtemp() + f"/{arch}", arch)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").cuda()
        ref.generation_config.eos_token_id = None
        expected = []
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            with torch.no_grad():
                out = ref.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24, do_sample=False
                )
            expected.append(out[0, len(p) :].tolist())
        llm = LLM(str(path), dtype="float32", device="cuda", max_num_batched_tokens=64)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            use_tqdm=False,
        )
        same = sum(o.outputs[0].token_ids == e for o, e in zip(outs, expected))
        rows.append(
            (
                f"engine {arch} (cuda graphs)",
                "float32 greedy vs transformers eager",
                f"{same}/{len(prompts)} equal",
                same == len(prompts),
            )
        )
        del llm, ref
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    rows = []
    import sys

    parts = (engine_rows,) if "--engine" in sys.argv else (kernel_rows, engine_rows)
    for part in parts:
        try:
            rows += part()
        except Exception as exc:  # report and go on to the next part
            rows.append((part.__name__, "failed", repr(exc)[:200], False))
    print("| check | case | result | ok |")
    print("|---|---|---|---|")
    for name, case, result, ok in rows:
        if not ok or "s=1" in case and "bfloat16" in case:  # every failure, and one line per shape/case
            print(f"| {name} | {case} | {result} | {'yes' if ok else 'NO'} |")
    print(f"{sum(ok for *_, ok in rows)}/{len(rows)} checks passed")


if __name__ == "__main__":
    main()
