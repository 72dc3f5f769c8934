"""Platform overhead: a 10,000-request job end to end (API -> Redis -> one worker -> Parquet) against the
same requests through the offline engine in the same run. Also: accepting and validating a 50,000-line
file, and the p99 latency of GET /v1/jobs/<id> under 100 concurrent pollers.

    python -m bench.platform [--requests 10000] [--max-tokens 16] [--rounds 3] [--model DIR]

The two are timed in alternating rounds (offline, platform, offline, platform, ...) with fresh prompts
each round; the ratio is the median of the rounds' ratios: on a shared machine a single pair mostly
measures the noise.
The offline engine is loaded once before the rounds, as the worker's is, so the ratio compares serving
with serving; what `pagedbatch run` also pays to load the model is printed apart. A warm-up round comes
first and is not counted: each side compiles and times its kernels for the job's shapes once, the offline
engine in its first run and the worker in its first job (on the AMD EPYC, offline ~10 s then ~5 s).

Uses PostgreSQL/Redis on 127.0.0.1 when they answer, else embedded ones. Targets: overhead <= 1.15 and
validation < 5 s; the pollers' p50 and p99 are reported.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

# This file is named like the stdlib's `platform`, which torch imports: take its directory off the path.
HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

from bench.stack import start_stack  # noqa: E402


def make_requests(n: int, max_tokens: int, round_: int = 0) -> bytes:
    """Half chat, half completion lines; each round's prompts differ, so no round reuses another's cache."""
    lines = []
    for i in range(n):
        if i % 2:
            body = {
                "model": "bench",
                "messages": [{"role": "user", "content": f"Question {i} of {round_}: say something."}],
            }
            url = "/v1/chat/completions"
        else:
            body = {"model": "bench", "prompt": f"Request number {i} of {round_} is about"}
            url = "/v1/completions"
        body.update(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}))
    return ("\n".join(lines) + "\n").encode()


AUTH: dict[str, str] = {}  # the Authorization header of the bench tenant's key, set in main()


def post_jsonl(base: str, data: bytes, model: str) -> dict:
    req = urllib.request.Request(
        f"{base}/v1/jobs?model={model}",
        data=data,
        method="POST",
        headers={"Content-Type": "application/x-ndjson", **AUTH},
    )
    return json.loads(urllib.request.urlopen(req, timeout=600).read())


def get_json(base: str, path: str, method: str = "GET") -> dict:
    req = urllib.request.Request(base + path, method=method, headers=AUTH)
    return json.loads(urllib.request.urlopen(req, timeout=60).read())


def poll_latencies(port: int, job_id: str, pollers: int, per_poller: int) -> list[float]:
    latencies: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(pollers)

    def poll():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        mine = []
        start.wait()
        for _ in range(per_poller):
            t = time.perf_counter()
            conn.request("GET", f"/v1/jobs/{job_id}", headers=AUTH)
            resp = conn.getresponse()
            resp.read()
            mine.append(time.perf_counter() - t)
        conn.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=poll) for _ in range(pollers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--validate-lines", type=int, default=50_000)
    parser.add_argument("--pollers", type=int, default=100)
    parser.add_argument("--polls-each", type=int, default=20)
    parser.add_argument("--model", help="model directory (default: a tiny random model)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--api-workers", type=int, default=2, help="gunicorn worker processes")
    parser.add_argument("--rounds", type=int, default=3, help="alternating offline/platform rounds, after a warm-up")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="pagedbatch-bench-"))
    if args.model:
        model_path = args.model
    else:
        from engine.testing.tiny import write_tiny_model

        model_path = str(write_tiny_model(tmp / "tiny", arch="qwen3"))

    from engine import LLM
    from workers.offline import run_offline

    t = time.perf_counter()
    llm = LLM(model=model_path)
    load_s = time.perf_counter() - t

    stack = start_stack(
        tmp,
        "bench",
        model_path,
        port=args.port,
        concurrency=args.concurrency,
        api_workers=args.api_workers,
        shard_size=args.shard_size,
        max_lines=max(args.validate_lines, args.requests),
    )
    base = stack.url
    rounds: list[tuple[float, float, float, float]] = []  # offline s, platform s, submit s, finalize s
    try:
        from store.keys import create_key

        AUTH["Authorization"] = "Bearer " + create_key(stack.settings, "bench")[0]
        for round_ in range(args.rounds + 1):  # round 0: the warm-up
            data = make_requests(args.requests, args.max_tokens, round_)
            src = tmp / f"requests-{round_}.jsonl"
            src.write_bytes(data)

            # ---- offline, the engine already loaded ----
            t = time.perf_counter()
            run_offline(str(src), str(tmp / "offline.parquet"), model_path, progress=False, llm=llm)
            offline_s = time.perf_counter() - t

            # ---- platform end to end ----
            t = time.perf_counter()
            job = post_jsonl(base, data, "bench")
            submit_s = time.perf_counter() - t
            while job["status"] not in ("completed", "failed", "cancelled"):
                time.sleep(0.1)
                job = get_json(base, f"/v1/jobs/{job['id']}")
            results = urllib.request.Request(f"{base}/v1/jobs/{job['id']}/results", headers=AUTH)
            with urllib.request.urlopen(results, timeout=600) as r:
                (tmp / "platform.parquet").write_bytes(r.read())
            platform_s = time.perf_counter() - t
            assert job["status"] == "completed" and job["request_counts"]["completed"] == args.requests, job
            finalize_s = job["completed_at"] - job["finalizing_at"]  # whole seconds
            if round_:
                rounds.append((offline_s, platform_s, submit_s, finalize_s))
            print(
                f"round {round_}{' (warm-up, not counted)' if not round_ else ''}: offline {offline_s:.2f} s, "
                f"platform {platform_s:.2f} s, ratio {platform_s / offline_s:.3f}",
                file=sys.stderr,
                flush=True,
            )

        # ---- accept and validate a large file ----
        big = make_requests(args.validate_lines, 4)
        t = time.perf_counter()
        vjob = post_jsonl(base, big, "bench")
        validate_s = time.perf_counter() - t
        get_json(base, f"/v1/jobs/{vjob['id']}/cancel", method="POST")

        # ---- GET /v1/jobs/<id> under concurrent pollers ----
        lat = sorted(poll_latencies(args.port, job["id"], args.pollers, args.polls_each))
        p50 = statistics.median(lat)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    finally:
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    offline_med = statistics.median(r[0] for r in rounds)
    platform_med = statistics.median(r[1] for r in rounds)
    ratios = [p / o for o, p, _, _ in rounds]  # each platform run against the offline run just before it
    ratio = statistics.median(ratios)
    per_round = ", ".join(f"{r:.2f}" for r in ratios)
    rows = [
        ("requests", f"{args.requests:,} x max_tokens {args.max_tokens}", f"{args.rounds} rounds after a warm-up"),
        ("offline engine (pagedbatch run), median", f"{offline_med:.2f} s", "engine loaded beforehand"),
        ("  model load, paid by each pagedbatch run", f"{load_s:.2f} s", "not in the ratio"),
        ("platform: API + Redis + 1 worker, median", f"{platform_med:.2f} s", ""),
        ("  of which: upload + validate + enqueue", f"{statistics.median(r[2] for r in rounds):.2f} s", ""),
        (
            "  of which: finalize (merge, output files)",
            f"~{statistics.median(r[3] for r in rounds):.0f} s",
            "whole seconds",
        ),
        ("overhead ratio, median of the rounds", f"{ratio:.3f}", "target <= 1.15"),
        ("  per round", per_round, ""),
        (f"accept + validate {args.validate_lines:,} lines", f"{validate_s:.2f} s", "target < 5 s"),
        (f"GET /v1/jobs/<id>, {args.pollers} pollers: p50", f"{p50 * 1000:.1f} ms", ""),
        (f"GET /v1/jobs/<id>, {args.pollers} pollers: p99", f"{p99 * 1000:.1f} ms", ""),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'metric':<{width}}  {'value':>24}  note")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>24}  {note}")


if __name__ == "__main__":
    main()
