"""Tensor parallelism on the CPU: output tokens/s of tensor_parallel_size=2 (two gloo ranks, two
processes) beside tensor_parallel_size=1, in one run, and whether their greedy tokens agree.

    python -m bench.tensor_parallel [--requests 16] [--rounds 2] [--threads N]

The model is a tiny random-weight Llama (hidden 512, 4 layers, 8 heads / 4 KV heads, intermediate 1536,
vocab 8000), float32. Each engine runs in a fresh process, the runs alternating, `--rounds` times; the
best time of each counts. Each rank of TP=2 runs torch with `--threads` threads (default: the cores
split between the ranks); TP=1 runs with all cores and with that many threads (on a busy host a
2-thread team waits for a descheduled thread at every parallel region, which 1-thread ranks never do).
On an idle 2-core machine expect TP=2 to be slower: the ranks share the cores and pay two all-reduces
per layer over loopback TCP; the point of TP there is memory per rank (printed: each rank's weight
bytes beside the single rank's).
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
CONFIG = dict(
    vocab_size=8000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)


def workload(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(10, CONFIG["vocab_size"]) for _ in range(rng.randint(16, 256))], rng.randint(16, 96))
        for _ in range(count)
    ]


def run_child(model: str, tp: str, count: str, threads: str) -> dict:
    import time

    import torch

    from engine import LLM, SamplingParams
    from engine.parallel.runner import weight_bytes

    torch.set_num_threads(int(threads))
    reqs = workload(int(count))
    llm = LLM(model, dtype="float32", device="cpu", tensor_parallel_size=int(tp))
    runner = llm.llm_engine.runner
    per_rank = runner.weight_bytes_per_rank() if int(tp) > 1 else [weight_bytes(runner.model)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate(
        [{"prompt_token_ids": list(range(10, 74))}], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    if int(tp) > 1:
        runner.close()
    return {"seconds": elapsed, "tokens": sum(map(len, tokens)), "outputs": tokens, "weight_bytes": per_rank}


def _run(model: Path, tp: int, count: int, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "bench.tensor_parallel", "--child", str(model), str(tp), str(count), str(threads)]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(run_child(*sys.argv[2:6])))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = parser.parse_args()
    from engine.testing.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "model", "llama", **CONFIG)
        runs = list(dict.fromkeys([(1, os.cpu_count() or 1), (1, args.threads), (2, args.threads)]))
        best: dict[tuple[int, int], dict] = {}
        for _ in range(args.rounds):
            for run in runs:
                result = _run(model, run[0], args.requests, run[1])
                if run not in best or result["seconds"] < best[run]["seconds"]:
                    best[run] = result
    one, two = best[runs[0]], best[runs[-1]]
    print(f"{args.requests} requests, {one['tokens']} output tokens, float32, best of {args.rounds}")
    print("| engine | ranks x threads | output tok/s | weight bytes per rank |")
    print("| --- | --- | --- | --- |")
    for (tp, threads), result in best.items():
        print(
            f"| TP={tp} | {tp} x {threads} | {result['tokens'] / result['seconds']:.1f} | "
            f"{' / '.join(f'{b:,}' for b in result['weight_bytes'])} |"
        )
    ratios = ", ".join(
        f"vs TP=1 x {threads}: {best[(1, threads)]['seconds'] / two['seconds']:.2f}x" for tp, threads in runs if tp == 1
    )
    print(
        f"TP=2 / TP=1 throughput {ratios}; weight bytes per rank: "
        f"{max(two['weight_bytes']) / one['weight_bytes'][0]:.2f}x; same greedy tokens: "
        f"{all(r['outputs'] == one['outputs'] for r in best.values())}"
    )


if __name__ == "__main__":
    main()
