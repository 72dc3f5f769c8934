"""CPU embedding throughput: our pooling engine (`LLM.embed`) vs sentence-transformers'
`encode`, the same model directory and corpus, in one run.

    python -m bench.embeddings [--inputs 256] [--batch-size 32] [--threads N] [--repeat N]

Workload: a Qwen3-shaped ~25M-parameter embedding model with random float32 weights
(sentence-transformers layout, last-token pooling, normalized, as Qwen3-Embedding); a corpus of
texts whose token lengths are drawn uniformly from [8, 512]. sentence-transformers sorts the corpus
by length and pads each batch to its longest input; the engine packs whole inputs (and chunks of
long ones) into steps of up to max_num_batched_tokens tokens with no padding; a step of pooling
prompts only runs `engine.pooling_forward` (attention on the fresh K/V, no paged gather; on CPU,
groups of ~1024 tokens). The vectors of
both are compared (minimum cosine) so that the speed is for the same result. Wall time and the
process's CPU time are both reported: on a shared machine the CPU-time ratio is the steadier one.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import numpy as np
import torch

from bench.engine_cpu import BENCH_CONFIG

_WORDS = ["paged", "attention", "stores", "the", "key", "value", "cache", "in", "fixed", "size", "blocks", "batch",
          "inference", "jobs", "results", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]


def corpus(tokenizer, count: int, seed: int = 0) -> list[str]:
    """`count` texts whose token counts are uniform in [8, 512] (to within a word)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        target = rng.randint(8, 512)
        words = [rng.choice(_WORDS) for _ in range(target)]
        lo, hi = 1, target  # the fewest words reaching the target length
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tokenizer(" ".join(words[:mid])).input_ids) >= target:
                hi = mid
            else:
                lo = mid + 1
        texts.append(" ".join(words[:lo]))
    return texts


def run_ours(path, texts, max_num_batched_tokens: int, repeat: int):
    from engine import LLM

    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=max_num_batched_tokens,
              enable_prefix_caching=False)
    llm.embed(texts[:4], use_tqdm=False)  # warm-up
    before = dict(llm.llm_engine.stats)
    elapsed = []
    for _ in range(repeat):
        start, cpu = time.perf_counter(), time.process_time()
        outs = llm.embed(texts, use_tqdm=False)
        elapsed.append((time.perf_counter() - start, time.process_time() - cpu))
    steps = (llm.llm_engine.stats["steps"] - before["steps"]) // repeat
    tokens = (llm.llm_engine.stats["tokens"] - before["tokens"]) // repeat
    print(f"  ours: {steps} steps, {tokens} tokens computed")
    return best(elapsed), np.array([o.outputs.embedding for o in outs])


def run_sentence_transformers(path, texts, batch_size: int, repeat: int):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
    model.encode(texts[:4], batch_size=batch_size)  # warm-up
    elapsed = []
    for _ in range(repeat):
        start, cpu = time.perf_counter(), time.process_time()
        vectors = model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
        elapsed.append((time.perf_counter() - start, time.process_time() - cpu))
    lengths = sorted((len(model.tokenizer(t).input_ids) for t in texts), reverse=True)
    padded = sum(max(lengths[b : b + batch_size]) * len(lengths[b : b + batch_size])
                 for b in range(0, len(lengths), batch_size))
    print(f"  sentence-transformers: {padded} tokens computed with padding ({padded / sum(lengths):.2f}x)")
    return best(elapsed), vectors


def best(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The fastest wall time and the least CPU time over the repeats (interference only adds)."""
    return min(w for w, _ in runs), min(c for _, c in runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=1, help="timed runs of each; the best is reported")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.tiny_embedding import write_tiny_embedding_model

    path = write_tiny_embedding_model(tempfile.mkdtemp() + "/bench-emb", "qwen3", "last", **BENCH_CONFIG)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    texts = corpus(tokenizer, args.inputs)
    tokens = sum(len(tokenizer(t).input_ids) for t in texts)
    print(f"model: Qwen3-shaped embedding model, float32, last-token pooling, {torch.get_num_threads()} threads, "
          f"best of {args.repeat} runs each")
    print(f"corpus: {len(texts)} texts, {tokens} tokens (8..512 each)")
    ours, our_vectors = run_ours(path, texts, args.max_num_batched_tokens, args.repeat)
    st, st_vectors = run_sentence_transformers(path, texts, args.batch_size, args.repeat)
    cos = (our_vectors * st_vectors).sum(1) / np.linalg.norm(our_vectors, axis=1) / np.linalg.norm(st_vectors, axis=1)
    print(f"  minimum cosine between the two: {cos.min():.6f}")
    print()
    print(f"| {'system':<44} | {'wall (s)':>8} | {'inputs/s':>8} | {'tokens/s':>9} | {'ours / peer':>11} | "
          f"{'CPU (s)':>8} | {'ours / peer (CPU)':>17} |")
    print(f"|{'-' * 46}|{'-' * 10}|{'-' * 10}|{'-' * 11}|{'-' * 13}|{'-' * 10}|{'-' * 19}|")
    rows = (("pagedbatch LLM.embed", ours), (f"sentence-transformers encode (batch {args.batch_size})", st))
    for name, (wall, cpu) in rows:
        print(f"| {name:<44} | {wall:8.2f} | {len(texts) / wall:8.1f} | {tokens / wall:9.0f} | "
              f"{wall / ours[0]:10.2f}x | {cpu:8.2f} | {cpu / ours[1]:16.2f}x |")


if __name__ == "__main__":
    main()
