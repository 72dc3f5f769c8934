"""KV transfer throughput: the same bytes through a plain memory copy, the in-process transport
(wire format only) and ZeroMQ over loopback TCP, in one run.

    python -m bench.kv_transfer [--tokens 512] [--layers 32] [--kv-heads 8] [--head-dim 128] [--repeat 15]
                                [--skip-workload]

Then, unless --skip-workload, `bench.pd_workload` (long prompts, short outputs: 1P+1D vs 2x both).

The default bundle is one 512-token prompt of a Llama-3-8B-shaped model in bfloat16 (128 KiB of
K and V per token, 64 MiB in all). Each row moves the whole bundle `--repeat` times and reports
the best and median GB/s (the machine may be shared: the median is the fairer ratio). Both ZeroMQ
endpoints live in this process, so the TCP row measures the stack and framing, not a network.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.kv_transfer.export import KVBundle, KVMeta
from workers.disagg.kv_transport import InProcessTransport
from workers.disagg.kv_zmq import ZmqTransport


def make_bundle(tokens: int, layers: int, kv_heads: int, head_dim: int, block_size: int = 16) -> KVBundle:
    blocks = -(-tokens // block_size)
    shape = (blocks, block_size, kv_heads, head_dim)
    meta = KVMeta(block_size, "bfloat16", layers, kv_heads, head_dim, "bench", "cpu")
    kv = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(layers)]
    return KVBundle("bench", meta, list(range(tokens)), 1, kv)


def timings(fns: list, repeat: int) -> list[tuple[float, float]]:
    """Each path once to warm up, then `repeat` interleaved rounds (so load spikes hit all paths
    alike); (best, median) seconds of each."""
    times = [[] for _ in fns]
    for round_ in range(repeat + 1):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            if round_:
                times[i].append(time.perf_counter() - start)
    return [(min(t), statistics.median(t)) for t in times]


def memcpy(bundle: KVBundle):
    """The bytes copied once into preallocated buffers, as raw bytes."""
    dst = [(torch.empty_like(k).view(torch.uint8), torch.empty_like(v).view(torch.uint8)) for k, v in bundle.layers]
    return lambda: [
        (dk.copy_(k.view(torch.uint8)), dv.copy_(v.view(torch.uint8))) for (dk, dv), (k, v) in zip(dst, bundle.layers)
    ]


def clone(bundle: KVBundle):
    """The bytes copied into freshly allocated buffers (what a receiver without a preallocated
    landing zone pays: page faults on new memory)."""
    return lambda: [(k.clone(), v.clone()) for k, v in bundle.layers]


def through(sender, receiver, bundle: KVBundle):
    counter = iter(range(1 << 30))

    def move():
        rid = f"r{next(counter)}"
        receiver.expect(rid)
        sender.send(receiver.address, rid, bundle)
        got, why = receiver.receive(rid, timeout=60)
        assert why is None and torch.equal(got.layers[-1][1], bundle.layers[-1][1]), why
        receiver.release(rid)

    return move


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--skip-workload", action="store_true", help="only the transfer table")
    args = ap.parse_args(argv)
    # One thread: the transports copy on one thread, and on a loaded machine an OpenMP team
    # waiting for a descheduled member makes a parallel copy_ hundreds of times slower.
    torch.set_num_threads(1)
    bundle = make_bundle(args.tokens, args.layers, args.kv_heads, args.head_dim)
    nbytes = bundle.nbytes
    registry = {}
    a, b = InProcessTransport("a", registry), InProcessTransport("b", registry)
    za, zb = ZmqTransport(), ZmqTransport()
    names = [
        "memory copy into preallocated buffers",
        "memory copy into new buffers (clone)",
        "in-process transport (wire format + assembly)",
        "ZeroMQ over loopback TCP",
    ]
    try:
        times = timings([memcpy(bundle), clone(bundle), through(a, b, bundle), through(za, zb, bundle)], args.repeat)
    finally:
        za.close()
        zb.close()
    rows = list(zip(names, times))
    print(
        f"bundle: {args.tokens} tokens x {args.layers} layers x {args.kv_heads} kv heads x {args.head_dim} "
        f"(bf16) = {nbytes / 2**20:.1f} MiB; {args.repeat} interleaved rounds; "
        f"torch threads {torch.get_num_threads()}"
    )
    print("| path | best s | median s | GB/s (best) | GB/s (median) | vs memory copy (median) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    base = rows[0][1][1]
    for name, (best, median) in rows:
        print(
            f"| {name} | {best:.4f} | {median:.4f} | {nbytes / best / 1e9:.2f} | {nbytes / median / 1e9:.2f} "
            f"| {base / median:.2f}x |"
        )
    if not args.skip_workload:
        print()
        from bench import pd_workload

        pd_workload.main([])


if __name__ == "__main__":
    main()
