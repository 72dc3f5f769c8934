"""Load: many tenants submitting small jobs and polling them at once, for a bounded time, against a
stack on loopback (API under gunicorn, one worker, PostgreSQL, Redis). Then every job is waited for and
every custom_id must come back exactly once across the outputs and error files.

    python -m bench.load [--tenants 50] [--duration 60] [--requests-per-job 4]
    python -m bench.load --url http://127.0.0.1:8000 --database-url postgresql://...   # a running stack

Prints one table: requests/s, p50/p99 latency per operation, 4xx/5xx counts, lost and duplicated
requests. Targets: zero 5xx, zero lost, zero duplicated. Keys are made with store.keys.create_key,
so with --url the stack's database URL is needed too.
"""

from __future__ import annotations

import argparse
import http.client
import json
import secrets
import shutil
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from bench.stack import start_stack

MODEL = "load"
TERMINAL = ("completed", "failed", "cancelled", "expired")


@dataclass
class Stats:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    failures: Counter = field(default_factory=Counter)  # connection errors and the like, per operation
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, op: str, seconds: float, status: int) -> None:
        with self.lock:
            self.latencies[op].append(seconds)
            self.statuses[op][status] += 1


class Client:
    """One keep-alive connection per thread, timing every request."""

    def __init__(self, url: str, key: str, stats: Stats):
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname, parsed.port or 80
        self.headers = {"Authorization": f"Bearer {key}"}
        self.stats = stats
        self.conn: http.client.HTTPConnection | None = None

    def call(self, op: str, method: str, path: str, body: bytes | None = None, content_type: str | None = None):
        headers = dict(self.headers)
        if content_type:
            headers["Content-Type"] = content_type
        for attempt in range(2):  # a keep-alive connection the server closed is retried once
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
            start = time.perf_counter()
            try:
                self.conn.request(method, path, body=body, headers=headers)
                response = self.conn.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt:
                    with self.stats.lock:
                        self.stats.failures[op] += 1
                    return None, b""
                continue
            self.stats.record(op, time.perf_counter() - start, response.status)
            if response.getheader("Connection", "").lower() == "close":
                self.conn.close()
                self.conn = None
            return response.status, data
        return None, b""


def job_body(tenant: str, index: int, per_job: int, max_tokens: int) -> bytes:
    lines = []
    for j in range(per_job):
        custom_id = f"{tenant}/{index}/{j}"
        if j % 2:
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Hi {custom_id}"}]}
        else:
            url, body = "/v1/completions", {"prompt": f"Request {custom_id} is about"}
        body.update(model=MODEL, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        lines.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}))
    return ("\n".join(lines) + "\n").encode()


def tenant_loop(url, tenant, key, args, deadline, stats, submitted, lock) -> None:
    """Until the deadline: submit a job, then poll this tenant's unfinished jobs once each."""
    client = Client(url, key, stats)
    mine: dict[str, list[str]] = {}  # job id -> its custom_ids
    open_jobs: list[str] = []
    index = 0
    while time.monotonic() < deadline:
        body = job_body(tenant, index, args.requests_per_job, args.max_tokens)
        status, data = client.call("POST /v1/jobs", "POST", f"/v1/jobs?model={MODEL}", body, "application/x-ndjson")
        if status == 201:
            job = json.loads(data)
            mine[job["id"]] = [f"{tenant}/{index}/{j}" for j in range(args.requests_per_job)]
            open_jobs.append(job["id"])
        index += 1
        still_open = []
        for job_id in open_jobs:
            if time.monotonic() >= deadline:
                still_open.append(job_id)
                continue
            status, data = client.call("GET /v1/jobs/<id>", "GET", f"/v1/jobs/{job_id}")
            if status != 200 or json.loads(data)["status"] not in TERMINAL:
                still_open.append(job_id)
        open_jobs = still_open
        time.sleep(args.think_s)
    with lock:
        submitted[tenant] = (key, mine)


def drain(url, tenant, key, jobs: dict[str, list[str]], stats, timeout: float, seen: Counter, lock) -> Counter:
    """Wait for the tenant's jobs, then count each custom_id in the output and error files."""
    client = Client(url, key, stats)
    outcome: Counter = Counter()
    deadline = time.monotonic() + timeout
    for job_id in jobs:
        while True:
            status, data = client.call("GET /v1/jobs/<id>", "GET", f"/v1/jobs/{job_id}")
            job = json.loads(data) if status == 200 else {}
            if job.get("status") in TERMINAL:
                outcome[job["status"]] += 1
                break
            if time.monotonic() > deadline:
                outcome["unfinished"] += 1
                break
            time.sleep(0.5)
        ids: list[str] = []
        for op, suffix in (("GET results", "results?format=jsonl"), ("GET errors", "errors")):
            status, data = client.call(op, "GET", f"/v1/jobs/{job_id}/{suffix}")
            if status == 200:
                ids += [json.loads(line)["custom_id"] for line in data.splitlines() if line.strip()]
        with lock:
            seen.update(ids)
    return outcome


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def make_keys(settings, tenants: list[str]) -> dict[str, str]:
    from store.keys import create_key

    return {tenant: create_key(settings, tenant, name="bench-load")[0] for tenant in tenants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=50)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of submitting and polling")
    parser.add_argument("--requests-per-job", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--think-s", type=float, default=0.05, help="pause of each tenant between rounds")
    parser.add_argument("--drain-timeout", type=float, default=600.0, help="seconds to wait for all jobs after")
    parser.add_argument("--url", help="a running stack (else one is started on loopback)")
    parser.add_argument("--database-url", help="with --url: the stack's database, where the keys are made")
    parser.add_argument("--model", help="model directory (default: a tiny random model)")
    parser.add_argument("--concurrency", type=int, default=4, help="shards in flight in the worker")
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--api-workers", type=int, default=2, help="gunicorn worker processes")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="pagedbatch-load-"))
    stop = None
    try:
        if args.url:
            if not args.database_url:
                parser.error("--url needs --database-url (API keys are made in the stack's database)")
            from store.settings import Settings

            url, settings = args.url.rstrip("/"), Settings.from_env(database_url=args.database_url)
        else:
            if args.model:
                model_path = args.model
            else:
                from engine.testing.tiny import write_tiny_model

                model_path = str(write_tiny_model(tmp / "tiny", arch="qwen3"))
            stack = start_stack(
                tmp,
                MODEL,
                model_path,
                port=args.port,
                concurrency=args.concurrency,
                api_workers=args.api_workers,
                shard_size=args.shard_size,
                # unlimited: this measures the platform, not the per-tenant limits
                max_active_jobs_per_tenant=0,
                max_queued_requests_per_tenant=0,
            )
            url, settings, stop = stack.url, stack.settings, stack.stop
        tenants = [f"load-{secrets.token_hex(3)}-{i:03d}" for i in range(args.tenants)]
        keys = make_keys(settings, tenants)

        stats, submitted, lock = Stats(), {}, threading.Lock()
        start = time.monotonic()
        deadline = start + args.duration
        threads = [
            threading.Thread(target=tenant_loop, args=(url, t, keys[t], args, deadline, stats, submitted, lock))
            for t in tenants
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        load_s = time.monotonic() - start
        load_counts = {op: len(v) for op, v in stats.latencies.items()}

        seen: Counter = Counter()
        outcomes: Counter = Counter()
        drain_start = time.monotonic()
        drainers = []
        for tenant, (key, jobs) in submitted.items():

            def run(tenant=tenant, key=key, jobs=jobs):
                result = drain(url, tenant, key, jobs, stats, args.drain_timeout, seen, lock)
                with lock:
                    outcomes.update(result)

            drainers.append(threading.Thread(target=run))
        for t in drainers:
            t.start()
        for t in drainers:
            t.join()
        drain_s = time.monotonic() - drain_start
    finally:
        if stop is not None:
            stop()
        shutil.rmtree(tmp, ignore_errors=True)

    expected = {cid for _, jobs in submitted.values() for ids in jobs.values() for cid in ids}
    lost = len(expected - set(seen))
    duplicated = sum(n - 1 for cid, n in seen.items() if n > 1)
    unexpected = len(set(seen) - expected)
    jobs_total = sum(len(jobs) for _, jobs in submitted.values())

    print(
        f"{args.tenants} tenants, {args.duration:.0f} s of load ({load_s:.1f} s measured), then {drain_s:.1f} s "
        f"until every job finished; {jobs_total} jobs x {args.requests_per_job} requests"
    )
    columns = ("requests", 9), ("req/s", 8), ("p50 ms", 8), ("p99 ms", 8), ("2xx", 7), ("4xx", 5), ("5xx", 5)
    header = f"{'operation':<20} " + " ".join(f"{name:>{width}}" for name, width in columns) + f" {'conn err':>8}"
    print(header)
    print("-" * len(header))
    for op in sorted(stats.latencies):
        lat, codes = stats.latencies[op], stats.statuses[op]
        rate = load_counts.get(op, 0) / load_s  # during the load window
        ok = sum(n for c, n in codes.items() if 200 <= c < 300)
        c4 = sum(n for c, n in codes.items() if 400 <= c < 500)
        c5 = sum(n for c, n in codes.items() if c >= 500)
        print(
            f"{op:<20} {len(lat):>9} {rate:>8.1f} {percentile(lat, 0.5) * 1000:>8.1f} "
            f"{percentile(lat, 0.99) * 1000:>8.1f} {ok:>7} {c4:>5} {c5:>5} {stats.failures[op]:>8}"
        )
    total = sum(load_counts.values())
    print(f"{'all (load window)':<20} {total:>9} {total / load_s:>8.1f}")
    print(f"jobs: {dict(outcomes)}")
    print(
        f"requests submitted {len(expected)}, returned {sum(seen.values())}: lost {lost}, duplicated {duplicated}, "
        f"unexpected {unexpected}   (targets: 0 5xx, 0 lost, 0 duplicated)"
    )


if __name__ == "__main__":
    main()
