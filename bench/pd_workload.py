"""Long prompts, short outputs: one prefill + one decode worker (1P+1D) against two `both` workers
(2x both), with the same two engine processes' worth of CPU, in one run.

    python -m bench.pd_workload [--requests 24] [--prompt 768] [--output 16]

Each configuration runs two processes, each with one engine host (one torch thread): 2x both splits
the requests between its two; 1P+1D sends them all to the decode process, which prefills them on
the prefill process through the real service (ZeroMQ, Redis registry) and imports the KV. The
model is `bench.engine_cpu`'s Qwen3-shaped one (random float32 weights). Reported: makespan,
mean and p90 time to first token (from submission), mean time per output token, and whether the
greedy outputs of both configurations agree token for token. This is engine hosts in processes,
not the Celery/PostgreSQL platform around them.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time

MODEL = "bench-pd"


def _host(path: str):
    from engine import LLMEngine
    from workers.host.engine_host import EngineHost

    return EngineHost(
        lambda: LLMEngine(path, dtype="float32", device="cpu", max_num_seqs=32, max_num_batched_tokens=1024)
    )


def _serve(role: str, path: str, redis_url: str, conn) -> None:
    import torch

    torch.set_num_threads(1)
    from engine import SamplingParams
    from workers.disagg.kv_zmq import ZmqTransport
    from workers.disagg.prefill_registry import Heartbeat, PrefillRegistry

    host = _host(path)
    registry = PrefillRegistry.from_url(redis_url, MODEL)
    if role == "prefill":
        from workers.disagg.prefill_service import PrefillServer

        transport = ZmqTransport()
        server = PrefillServer(host, transport)
        heartbeat = Heartbeat(registry, server.address)
        conn.send("ready")
        conn.recv()
        heartbeat.stop()
        server.close()
        transport.close()
        host.close()
        return
    if role == "decode":
        from workers.disagg.remote_prefill import RemotePrefill

        host.remote_prefill = RemotePrefill(host.engine, registry, ZmqTransport(), max_in_flight=8)
    conn.send("ready")
    requests = conn.recv()
    start = time.time()
    futures = host.submit_many(
        [
            (rid, {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for rid, ids, n in requests
        ]
    )
    results = {}
    for (rid, _, n), f in zip(requests, futures):
        out = f.result()
        m = out.metrics
        results[rid] = (
            out.outputs[0].token_ids,
            m["first_token_time"] - start,
            (m["finished_time"] - m["first_token_time"]) / max(1, n - 1),
            m["finished_time"] - start,
        )
    conn.send(results)
    host.close()


def _run(roles: list[str], path: str, redis_url: str, requests) -> dict:
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for role in roles:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_serve, args=(role, path, redis_url, child), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    for c in conns:
        assert c.recv() == "ready"
    servers = [c for c, r in zip(conns, roles) if r != "prefill"]
    for i, c in enumerate(servers):
        c.send(requests[i :: len(servers)])
    results = {}
    for c in servers:
        results.update(c.recv())
    for c, r in zip(conns, roles):
        if r == "prefill":
            c.send("stop")
    for p in procs:
        p.join(timeout=30)
    return results


def _summary(name: str, results: dict) -> str:
    ttft = sorted(r[1] for r in results.values())
    tpot = [r[2] for r in results.values()]
    makespan = max(r[3] for r in results.values())
    p90 = ttft[int(0.9 * (len(ttft) - 1))]
    return (
        f"| {name} | {makespan:.2f} | {statistics.mean(ttft):.2f} | {p90:.2f} | {1000 * statistics.mean(tpot):.1f} |"
    ), makespan


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=768)
    ap.add_argument("--output", type=int, default=16)
    args = ap.parse_args(argv)
    from bench.engine_cpu import BENCH_CONFIG
    from engine.testing.tiny import write_tiny_model
    from pagedbatch.embedded import LOCAL_REDIS, servers_or_embedded

    rng = random.Random(0)
    requests = [
        (f"r{i}", [rng.randrange(BENCH_CONFIG["vocab_size"]) for _ in range(args.prompt)], args.output)
        for i in range(args.requests)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_model(os.path.join(tmp, "model"), "qwen3", **BENCH_CONFIG))
        _, redis_url, stops = servers_or_embedded(
            tmp, redis_url=os.environ.get("PAGEDBATCH_BENCH_REDIS_URL", LOCAL_REDIS)
        )
        try:
            both = _run(["both", "both"], path, redis_url, requests)
            split = _run(["prefill", "decode"], path, redis_url, requests)
        finally:
            for stop in stops:
                stop()
    print(
        f"{args.requests} requests, prompt {args.prompt} tokens, output {args.output} tokens (greedy); "
        f"two processes of one torch thread each; cores on this machine: {os.cpu_count()}"
    )
    print("| configuration | makespan s | TTFT mean s | TTFT p90 s | TPOT mean ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    row_both, t_both = _summary("2x both", both)
    row_split, t_split = _summary("1P+1D", split)
    print(row_both)
    print(row_split)
    same = all(both[rid][0] == split[rid][0] for rid in both)
    print(f"makespan ratio 1P+1D / 2x both: {t_split / t_both:.2f}; greedy outputs identical: {same}")


if __name__ == "__main__":
    main()
