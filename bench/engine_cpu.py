"""CPU throughput: our engine vs transformers `generate` (static batches of 32) and
transformers `generate_batch` (continuous batching), in one run.

    python -m bench.engine_cpu [--requests 64] [--skip-generate-batch]

(Run benchmarks as modules: `bench/platform.py` would shadow the standard library
module of that name if `bench/` were put first on the path.)

Workload: a Qwen3-shaped model of ~25M parameters with random float32 weights; 64
requests whose prompt and output lengths are drawn uniformly from [16, 256]; EOS ignored.
Throughput counts only the requested output tokens (a static batch also computes the
padding up to its longest request; that waste is what continuous batching removes).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

BENCH_CONFIG = dict(
    vocab_size=10000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
    initializer_range=0.02,
)


def workload(count: int, seed: int = 0):
    rng = random.Random(seed)
    prompt_lens = [rng.randint(16, 256) for _ in range(count)]
    output_lens = [rng.randint(16, 256) for _ in range(count)]
    prompts = [[rng.randrange(BENCH_CONFIG["vocab_size"]) for _ in range(n)] for n in prompt_lens]
    return prompts, output_lens


def run_ours(path, prompts, output_lens) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", device="cpu")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    warmup = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], warmup)
    before = dict(llm.llm_engine.stats)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == output_lens
    steps = llm.llm_engine.stats["steps"] - before["steps"]
    seqs = llm.llm_engine.stats["batched_seqs"] - before["batched_seqs"]
    print(f"  ours: {steps} steps, mean {seqs / steps:.1f} sequences per step")
    return elapsed


def load_reference(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def run_static_generate(model, prompts, output_lens, batch_size: int = 32) -> float:
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch, lens = prompts[b : b + batch_size], output_lens[b : b + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False)
        assert out.shape[1] == width + max(lens)
    return time.perf_counter() - start


@torch.no_grad()
def run_generate_batch(model, prompts, output_lens) -> float:
    """transformers' continuous batching, each request with its own max_new_tokens."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max(output_lens))
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        for i, (p, n) in enumerate(zip(prompts, output_lens)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        done = 0
        while done < len(prompts):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("transformers generate_batch stalled")
            if result.is_finished():
                done += 1
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--skip-generate-batch", action="store_true")
    args = parser.parse_args()
    from engine.testing.tiny import write_tiny_model

    path = write_tiny_model(tempfile.mkdtemp() + "/bench-qwen3", "qwen3", **BENCH_CONFIG)
    prompts, output_lens = workload(args.requests)
    tokens = sum(output_lens)
    ref = load_reference(path)
    params = sum(p.numel() for p in ref.parameters())
    print(f"model: Qwen3-shaped, {params / 1e6:.1f}M parameters, float32, {torch.get_num_threads()} threads")
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {tokens} output tokens")

    rows = [("pagedbatch engine", run_ours(path, prompts, output_lens))]
    rows.append(("transformers generate (static, batch 32)", run_static_generate(ref, prompts, output_lens)))
    if not args.skip_generate_batch:
        rows.append(("transformers generate_batch (continuous)", run_generate_batch(ref, prompts, output_lens)))

    ours = rows[0][1]
    print()
    print(f"| {'system':<42} | {'time (s)':>8} | {'output tok/s':>12} | {'ours / peer':>11} |")
    print(f"|{'-' * 44}|{'-' * 10}|{'-' * 14}|{'-' * 13}|")
    for name, seconds in rows:
        print(f"| {name:<42} | {seconds:8.2f} | {tokens / seconds:12.1f} | {seconds / ours:10.2f}x |")


if __name__ == "__main__":
    main()
