"""Whole-file prefix planning (issue 35): a shuffled job in which `--groups` system prompts of `--system-tokens`
tokens are each shared by `--per-group` lines, on 2 workers whose KV pool holds only a few sequences, run in file
order (PAGEDBATCH_PLAN_PREFIXES=0, today's platform) and planned, side by side on the same workers, plus the
quote of the planned run taken before it runs.

    python -m bench.prefix_plan [--groups 8] [--per-group 64] [--system-tokens 512] [--kv-blocks 160]

Both runs go through the same stack (database, Redis, the same 2 worker processes): two API processes on it,
one planning and one not. Before each run one flush job per worker slot, of unrelated long prompts, empties
every worker's prefix cache, so neither run inherits the other's prefixes. Ideal cached tokens: every shared
prefix computed once per worker, (lines of a group - workers) x shared full-block tokens, summed over the
groups. The two runs' outputs are compared row by row (same order, same tokens).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq

from bench.stack import REPO, spawn, start_stack, stop_processes, wait_until_ready

AUTH: dict[str, str] = {}


def _call(base: str, path: str, data: bytes | None = None, method: str | None = None) -> dict:
    headers = {"Content-Type": "application/x-ndjson", **AUTH} if data is not None else AUTH
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    return json.loads(urllib.request.urlopen(req, timeout=600).read())


def make_job(groups: int, per_group: int, system_tokens: int, suffix: int, max_tokens: int, vocab: int) -> bytes:
    rng = random.Random(35)
    systems = [[rng.randrange(10, vocab) for _ in range(system_tokens)] for _ in range(groups)]
    lines = []
    for g in range(groups):
        for i in range(per_group):
            prompt = systems[g] + [rng.randrange(10, vocab) for _ in range(suffix)]
            body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            lines.append({"custom_id": f"g{g}-{i}", "method": "POST", "url": "/v1/completions", "body": body})
    rng.shuffle(lines)
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def flush_job(count: int, tokens: int, vocab: int, seed: int) -> bytes:
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        body = {"model": "bench", "prompt": [rng.randrange(10, vocab) for _ in range(tokens)], "max_tokens": 1}
        lines.append({"custom_id": f"f{i}", "method": "POST", "url": "/v1/completions", "body": body})
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def flush_caches(base: str, slots: int, tokens: int, kv_blocks: int, vocab: int, seed: int) -> None:
    """One small job per worker slot, sent at once: each worker takes `concurrency` of them (prefetch 1), so
    every worker's pool is filled with unrelated blocks and no prefix survives from the run before."""
    lines = -(-kv_blocks * 16 // tokens) + 1  # one job's lines fill a pool (each job is one shard)
    with ThreadPoolExecutor(slots) as pool:
        list(pool.map(lambda i: run_job(base, flush_job(lines, tokens, vocab, seed * 100 + i)), range(slots)))


def run_job(base: str, data: bytes) -> tuple[dict, float]:
    t = time.perf_counter()
    job = _call(base, "/v1/jobs?model=bench", data)
    while job["status"] not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.1)
        job = _call(base, f"/v1/jobs/{job['id']}")
    assert job["status"] == "completed", job
    return job, time.perf_counter() - t


def results(base: str, job_id: str):
    req = urllib.request.Request(f"{base}/v1/jobs/{job_id}/results", headers=AUTH)
    with urllib.request.urlopen(req, timeout=600) as r:
        return pq.read_table(io.BytesIO(r.read())).to_pydict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=160, help="per worker: about 4 of these sequences")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2, help="shard tasks in flight per worker")
    parser.add_argument("--port", type=int, default=8795)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="pagedbatch-plan-"))
    from engine.testing.tiny import write_tiny_model

    model_path = str(write_tiny_model(tmp / "tiny", arch="qwen3"))
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    stack = start_stack(
        tmp,
        "bench",
        model_path,
        port=args.port,
        concurrency=args.concurrency,
        api_workers=1,
        workers=args.workers,
        worker_args=(f"--num-kv-blocks={args.kv_blocks}", "--device=cpu"),
        plan_prefixes=True,
    )
    unplanned_base = f"http://127.0.0.1:{args.port + 1}"
    env = {**os.environ, **stack.settings.to_env(), "PAGEDBATCH_PLAN_PREFIXES": "0"}
    cmd = [sys.executable, "-m", "pagedbatch", "api", "--host", "127.0.0.1", f"--port={args.port + 1}"]
    unplanned_api: list[subprocess.Popen] = [spawn(cmd + ["--workers=1"], env=env, cwd=REPO, log=tmp / "api-0.log")]
    try:
        wait_until_ready(unplanned_base)
        from store.keys import create_key

        AUTH["Authorization"] = "Bearer " + create_key(stack.settings, "bench")[0]
        data = make_job(args.groups, args.per_group, args.system_tokens, args.suffix_tokens, args.max_tokens, vocab)
        flush_tokens = args.system_tokens + args.suffix_tokens
        runs = {}
        for n, (name, base) in enumerate((("file order", unplanned_base), ("planned", stack.url))):
            flush_caches(stack.url, args.workers * args.concurrency, flush_tokens, args.kv_blocks, vocab, n)
            quote = _call(base, "/v1/jobs?model=bench&dry_run=true", data) if name == "planned" else None
            if quote is not None:
                from store.lifecycle.quotes import _fit
                from store.models_registry import worker_throughput

                fits = [_fit(rates) for rates in worker_throughput(stack.settings, "bench")]
                print(f"workers' fitted (s/step, s/token): {fits}", file=sys.stderr)
            job, seconds = run_job(base, data)
            runs[name] = (job, seconds, results(base, job["id"]), quote)
            print(json.dumps({"run": name, "seconds": seconds, "job": job, "quote": quote}), file=sys.stderr)
    finally:
        stop_processes(unplanned_api)
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    block = 16
    shared = args.system_tokens // block * block
    ideal = args.groups * max(0, args.per_group - args.workers) * shared
    base_job, base_s, base_rows, _ = runs["file order"]
    plan_job, plan_s, plan_rows, quote = runs["planned"]
    same_order = base_rows["custom_id"] == plan_rows["custom_id"]
    compared = (
        "line",
        "status",
        "output_token_ids",
        "output_text",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
    )
    same_results = same_order and all(base_rows[c] == plan_rows[c] for c in compared)

    def cached(job):
        return job["usage"]["prompt_tokens_details"]["cached_tokens"]

    print(f"{args.groups} system prompts x {args.per_group} lines, {args.system_tokens}-token prefixes, shuffled; ")
    print(f"{args.workers} workers, {args.kv_blocks} KV blocks each; ideal cached tokens {ideal:,}")
    print(f"{'run':<12} {'prompt tok':>11} {'cached tok':>11} {'% of ideal':>10} {'expected':>10} {'job s':>8}")
    for name, (job, seconds, _, _) in runs.items():
        plan = job["plan"]
        print(
            f"{name:<12} {job['usage']['prompt_tokens']:>11,} {cached(job):>11,} {100 * cached(job) / ideal:>9.1f}% "
            f"{plan['expected_cached_tokens']:>10,} {seconds:>8.2f}"
        )
    print(f"planned / file order job time: {plan_s / base_s:.3f}")
    print(f"output order equal: {same_order}; every result equal: {same_results}")
    if quote is not None:
        print(
            f"quote: prompt {quote['prompt_tokens']:,} (measured {plan_job['usage']['prompt_tokens']:,}), "
            f"cached {quote['expected_cached_tokens']:,} (measured {cached(plan_job):,}), "
            f"run time {quote['estimated_run_seconds']:.2f} s (measured {plan_s:.2f} s, "
            f"ratio {quote['estimated_run_seconds'] / plan_s:.2f})"
        )


if __name__ == "__main__":
    main()
