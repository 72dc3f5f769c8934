"""Fair share across tenants in one worker: tenant B's small-job latency while tenant A's 512-request job
runs, first come first served (PAGEDBATCH_FAIR_SHARE=0) and with fair share, in one run.

    python -m bench.fairness [--model PATH] [--device cpu] [--a-tokens 128]

It drives the worker's `EngineHost` (where admission happens) directly, without broker or database.
B's idle latency (best of 3) is measured on the same host before A starts; B's latency while A runs is the
median of up to LOADED_SAMPLES runs of B's job before A's ends (one, first come first served).
Target (issue 12): B within 3x of idle.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import wait

from engine import LLMEngine, SamplingParams
from workers.engine_host import EngineHost

A_REQUESTS, B_REQUESTS, B_TOKENS = 512, 4, 4
LOADED_SAMPLES = 5  # B's job is run up to this many times while A's runs; the median is reported


def _submit(host: EngineHost, tenant: str, count: int, max_tokens: int, tag: str):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch = [(f"{tag}{i}", {"prompt_token_ids": [11, 12, 13 + i % 50, 14]}, params) for i in range(count)]
    return host.submit_many(batch, tenant=tenant)


def _b_latency(host: EngineHost, tag: str) -> float:
    t0 = time.perf_counter()
    wait(_submit(host, "b", B_REQUESTS, B_TOKENS, tag))
    return time.perf_counter() - t0


def measure(model: str, device: str, fair: bool, a_tokens: int) -> dict:
    os.environ["PAGEDBATCH_FAIR_SHARE"] = "1" if fair else "0"
    host = EngineHost(lambda: LLMEngine(model=model, device=device))
    try:
        _b_latency(host, "warm")
        idle = min(_b_latency(host, f"idle{i}") for i in range(3))
        t0 = time.perf_counter()
        a_futures = _submit(host, "a", A_REQUESTS, a_tokens, "a")
        time.sleep(0.5)  # A's job is running
        samples = [_b_latency(host, "loaded0")]
        a_done_before_b = sum(f.done() for f in a_futures)
        while len(samples) < LOADED_SAMPLES and not all(f.done() for f in a_futures):
            time.sleep(0.1)
            samples.append(_b_latency(host, f"loaded{len(samples)}"))
        loaded = statistics.median(samples)
        wait(a_futures)
        a_seconds = time.perf_counter() - t0
    finally:
        host.close()
    return {"mode": "fair share" if fair else "first come first served", "idle": idle, "loaded": loaded,
            "a_done_before_b": a_done_before_b, "a_seconds": a_seconds}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: a tiny random model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--a-tokens", type=int, default=128, help="output tokens of each of A's requests")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from engine.tiny import write_tiny_model

        model = str(write_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"), arch="qwen3"))
    rows = [measure(model, args.device, fair, args.a_tokens) for fair in (False, True)]
    print(f"A: {A_REQUESTS} requests x {args.a_tokens} tokens; B: {B_REQUESTS} requests x {B_TOKENS} tokens\n")
    print("| admission | B idle (s) | B while A runs (s) | ratio | A's requests done before B's first | A's job (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['idle']:.3f} | {r['loaded']:.3f} | {r['loaded'] / r['idle']:.1f}x "
              f"| {r['a_done_before_b']} | {r['a_seconds']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
