"""Multi-LoRA throughput: one batch whose requests run under 4 different LoRA adapters and the base
model (a fifth each), against the same batch on the base model alone (an engine without LoRA), in one
run; prints output tokens/s of each and their ratio (the target: >= 0.8).

    python -m bench.lora [--requests 40] [--rank 16] [--prompt-len 128] [--max-tokens 64] [--device cpu]
                         [--repeat 3] [--threads 0]

Workload: bench.engine_cpu's Qwen3-shaped ~25M-parameter model with random float32 weights; adapters of
rank `--rank` on all seven projections (q/k/v/o/gate/up/down: the most work an adapter adds), random
weights written as PEFT directories; prompts of random tokens, EOS ignored. Runs alternate between the
two engines and the best of `--repeat` is kept.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.engine_cpu import BENCH_CONFIG

MODULES = {
    "q_proj": ("self_attn", "q"),
    "k_proj": ("self_attn", "kv"),
    "v_proj": ("self_attn", "kv"),
    "o_proj": ("self_attn", "o"),
    "gate_proj": ("mlp", "i"),
    "up_proj": ("mlp", "i"),
    "down_proj": ("mlp", "d"),
}


def write_adapter(path: Path, rank: int, seed: int) -> str:
    """A PEFT adapter directory with random A and B on every projection of every layer."""
    from safetensors.torch import save_file

    c = BENCH_CONFIG
    h, heads, kv, d, inter = (
        c["hidden_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
        c["intermediate_size"],
    )
    shapes = {"q": (h, heads * d), "kv": (h, kv * d), "o": (heads * d, h), "i": (h, inter), "d": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        for module, (block, kind) in MODULES.items():
            fan_in, fan_out = shapes[kind]
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)})
    )
    return str(path)


def run(llm, prompts, params, loras) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    return sum(p.max_tokens for p in params) / elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from engine import LLM, LoRARequest, SamplingParams
    from engine.testing.tiny import write_tiny_model

    root = Path(tempfile.mkdtemp())
    path = write_tiny_model(root / "bench-qwen3", "qwen3", **BENCH_CONFIG)
    adapters = [
        LoRARequest(f"adapter-{i}", i, write_adapter(root / f"adapter-{i}", args.rank, i)) for i in (1, 2, 3, 4)
    ]
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(BENCH_CONFIG["vocab_size"]) for _ in range(args.prompt_len)]}
        for _ in range(args.requests)
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True) for _ in prompts]
    loras = [([None] + adapters)[i % 5] for i in range(args.requests)]
    common = dict(dtype="float32", device=args.device, enable_prefix_caching=False)
    base = LLM(str(path), **common)
    multi = LLM(str(path), enable_lora=True, max_loras=4, max_lora_rank=args.rank, **common)
    for llm, lora in ((base, None), (multi, loras)):  # warm-up
        run(llm, prompts[:5], params[:5], lora[:5] if lora else None)
    best = {"base": 0.0, "lora": 0.0}
    for _ in range(args.repeat):
        best["base"] = max(best["base"], run(base, prompts, params, None))
        best["lora"] = max(best["lora"], run(multi, prompts, params, loras))
    print(
        f"model: Qwen3-shaped ~25M parameters, float32, {args.device}, {torch.get_num_threads()} threads; "
        f"4 adapters of rank {args.rank} on q/k/v/o/gate/up/down"
    )
    print(
        f"workload: {args.requests} requests x {args.prompt_len} prompt + {args.max_tokens} output tokens, "
        f"best of {args.repeat}"
    )
    print("| run | output tokens/s |\n| --- | --- |")
    print(f"| base model alone | {best['base']:.0f} |")
    print(f"| 4 adapters + base, one batch | {best['lora']:.0f} |")
    print(f"ratio (LoRA batch / base alone): {best['lora'] / best['base']:.2f}x")


if __name__ == "__main__":
    main()
