"""GPU benchmark in one command, one process, one report:

    python -m bench.gpu                  # the full run (about 4-6 minutes on an H200)
    python -m bench.gpu --quick          # a smaller smoke run on the GPU
    python -m bench.gpu --cpu-smoke      # a tiny model on CPU: checks the script itself
    python -m bench.gpu --time-budget 420

1. Every Triton kernel against its torch twin on the GPU in bf16, and decode-attention
   bandwidth against the card's copy bandwidth (bench.gpu_kernels).
2. The headline: a Qwen3-0.6B-shaped model (hidden 1024, 28 layers, 16/8 heads, head dim
   128, intermediate 3072, vocab 151936, tied embeddings) with random bf16 weights; 256
   requests; rng = random.Random(0) draws 256 prompt lengths, then 256 output lengths,
   uniform in [100, 1024], then each prompt's token ids in [0, 10000]; EOS ignored; one
   warm-up run first. Output tokens/s, total time, mean batch, KV pool, GPU-busy fraction
   (device time of forward passes and logits, by CUDA events, over wall time).
3. transformers `generate` (one static batch, left-padded) on the first 64 requests, and
   our engine on the same 64, in the same process.
4. The bandwidth floor: every decode step reads all weights once plus the K/V of every
   live token; at the measured copy bandwidth the workload cannot finish faster.

Each part is guarded: a failure is printed and the next part runs. Run it as a module
(`bench/platform.py` would shadow the standard library's `platform` as a script).
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
import traceback
from pathlib import Path

import torch

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
)
SMOKE_MODEL = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=True,
    max_position_embeddings=512,
    initializer_range=0.02,
)
HEADLINE_TARGET = 25_000  # output tokens/s on an H200
ATTENTION_TARGET = 0.70  # decode attention, fraction of copy bandwidth, 256 x 1024


def workload(count: int, lo: int, hi: int, max_id: int, seed: int = 0):
    """`count` prompt lengths, then `count` output lengths, then each prompt's ids."""
    rng = random.Random(seed)
    prompt_lens = [rng.randint(lo, hi) for _ in range(count)]
    output_lens = [rng.randint(lo, hi) for _ in range(count)]
    prompts = [[rng.randint(0, max_id) for _ in range(n)] for n in prompt_lens]
    return prompts, output_lens


class Plan:
    """What a run does: the full benchmark, --quick, or --cpu-smoke."""

    def __init__(self, args):
        self.device = "cpu" if args.cpu_smoke else "cuda"
        self.dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
        self.model = SMOKE_MODEL if args.cpu_smoke else QWEN3_0_6B
        lo, hi = (8, 32) if args.cpu_smoke else (100, 1024)
        self.max_model_len = 2 * hi
        drawn = 16 if args.cpu_smoke else 256
        self.prompts, self.output_lens = workload(drawn, lo, hi, max_id=min(10000, self.model["vocab_size"] - 1))
        headline = 8 if args.cpu_smoke else 64 if args.quick else 256
        self.headline = headline
        self.compare = min(args.compare_requests or (4 if args.cpu_smoke else 16 if args.quick else 64), headline)
        self.engine_kwargs = dict(
            device=self.device,
            dtype="float32" if args.cpu_smoke else "bfloat16",
            max_model_len=self.max_model_len,
            max_num_seqs=256,
            max_num_batched_tokens=16384,
            # Random prompts share no prefix; off, a second pass over the same prompts gets no hits.
            enable_prefix_caching=False,
        )
        if args.cpu_smoke:  # no graphs on CPU: run decode steps through their padded buffers anyway
            self.engine_kwargs.update(static_decode_eager=True, async_scheduling=True)  # and the GPU's stepping
        self.deadline = time.monotonic() + args.time_budget

    def left(self) -> float:
        return self.deadline - time.monotonic()


def section(title: str) -> None:
    print(f"\n## {title}", flush=True)


def guarded(name: str, results: dict):
    """Decorator-free guard: run fn, store its result or the error under `name`."""

    def run(fn, *args, **kwargs):
        start = time.monotonic()
        try:
            results[name] = fn(*args, **kwargs)
        except Exception as exc:  # report and go on to the next part
            results[name] = None
            results.setdefault("errors", []).append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"# {name} FAILED after {time.monotonic() - start:.0f}s:", flush=True)
            traceback.print_exc()
        else:
            print(f"# {name} done in {time.monotonic() - start:.0f}s", flush=True)
        return results[name]

    return run


# ---- 1. kernels ------------------------------------------------------------------------


def kernel_checks():
    from bench.gpu_kernels import check_kernels_on_gpu, print_tables

    checks, bandwidth = check_kernels_on_gpu()
    print_tables(checks, bandwidth)
    headline = next(r for r in bandwidth if r["case"].startswith("decode 256x1024"))
    verdict = "PASS" if headline["fraction_of_copy"] >= ATTENTION_TARGET else "FAIL"
    print(
        f"target: decode attention 256x1024 >= {ATTENTION_TARGET:.0%} of copy bandwidth: "
        f"{headline['fraction_of_copy']:.0%} {verdict}"
    )
    return dict(
        checks=checks,
        bandwidth=bandwidth,
        all_ok=all(c[3] for c in checks),
        copy_gbps=headline["copy_gbps"],
        attention_fraction=headline["fraction_of_copy"],
    )


def copy_bandwidth_gbps(device: str) -> float:
    """Read + write bytes per second of a 1 GiB (CPU: 256 MiB) device-to-device copy."""
    size = (1 << 30) if device == "cuda" else (1 << 28)
    src = torch.empty(size // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 20
    else:
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        seconds = (time.perf_counter() - t0) / 5
    return 2 * size / seconds / 1e9


# ---- 2. model and engine ---------------------------------------------------------------


def build_model(plan: Plan):
    """A Qwen3-shaped checkpoint with random weights, written to a temp dir; also returns the
    transformers model (kept on the device for part 3)."""
    from transformers import AutoModelForCausalLM

    from engine.testing.tiny import build_tokenizer, tiny_config

    path = Path(tempfile.mkdtemp(prefix="pagedbatch-bench-")) / "qwen3"
    config = tiny_config("qwen3", **plan.model)
    torch.manual_seed(0)
    with torch.device(plan.device):  # random init on the GPU is quick
        model = AutoModelForCausalLM.from_config(config, dtype=plan.dtype)
    model.to(plan.device)
    model.save_pretrained(path)
    build_tokenizer(512).save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3-shaped, {params / 1e6:.0f}M parameters, {plan.dtype}, random weights, at {path}")
    return path, model.eval()


class BusyMeter:
    """CUDA events around every forward pass, logits projection and graph replay."""

    def __init__(self, runner):
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.handles = []
        for module in (runner.model, runner.model.lm_head):
            self.handles.append(module.register_forward_pre_hook(lambda *_: self._start()))
            self.handles.append(module.register_forward_hook(lambda *_: self._end()))
        self.graph_runner = runner.graph_runner
        self.originals = {}
        if self.graph_runner is not None:
            for size, graph in self.graph_runner.graphs.items():
                self.originals[size] = graph
                self.graph_runner.graphs[size] = _TimedGraph(graph, self)

    def _start(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.pairs.append((event, None))

    def _end(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.pairs[-1] = (self.pairs[-1][0], event)

    def reset(self):
        self.pairs = []

    def seconds(self) -> float:
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for s, e in self.pairs if e is not None) / 1e3

    def close(self):
        for h in self.handles:
            h.remove()
        if self.graph_runner is not None:
            self.graph_runner.graphs.update(self.originals)


class _TimedGraph:
    def __init__(self, graph, meter: BusyMeter):
        self.graph, self.meter = graph, meter

    def replay(self):
        self.meter._start()
        self.graph.replay()
        self.meter._end()


def timed_generate(llm, prompts, output_lens, meter: BusyMeter | None):
    from engine import SamplingParams

    engine = llm.llm_engine
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    before = dict(engine.stats)
    if meter is not None:
        meter.reset()
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    got = [len(o.outputs[0].token_ids) for o in outs]
    assert got == list(output_lens), "an engine request stopped early"
    steps = engine.stats["steps"] - before["steps"]
    return dict(
        seconds=seconds,
        tokens=sum(output_lens),
        tok_s=sum(output_lens) / seconds,
        steps=steps,
        mean_batch=(engine.stats["batched_seqs"] - before["batched_seqs"]) / max(steps, 1),
        busy=meter.seconds() / seconds if meter is not None else None,
    )


def run_engine(plan: Plan, path: Path, results: dict):
    """Start the engine, warm up, run the headline workload, then the comparison subset."""
    from engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(path), **plan.engine_kwargs)
    startup = time.perf_counter() - start
    runner = llm.llm_engine.runner
    graphs = runner.graph_runner
    block_bytes = runner._bytes_per_block()
    info = dict(
        startup_s=startup,
        num_blocks=runner.num_blocks,
        pool_tokens=runner.num_blocks * runner.block_size,
        pool_gib=runner.num_blocks * block_bytes / 2**30,
        graphs=len(graphs.graphs) if graphs is not None else 0,
        kv_bytes_per_token=block_bytes // runner.block_size,
    )
    print(
        f"engine: started in {startup:.1f}s, KV pool {info['pool_tokens']} tokens "
        f"({info['pool_gib']:.1f} GiB), {info['graphs']} decode graphs",
        flush=True,
    )
    results["engine"] = info
    results["async_scheduling"] = llm.llm_engine.async_scheduling

    # One warm-up run: every prompt length class of kernel, batch sizes up to 256, decode
    # graphs. Its ids are outside the workload's range (no prefix could match anyway).
    rng = random.Random(1)
    vocab = plan.model["vocab_size"]
    longest = min(96, plan.max_model_len // 2)
    warm = [
        [rng.randint(min(10001, vocab - 1), vocab - 1) for _ in range(rng.randint(8, longest))]
        for _ in range(len(plan.prompts))
    ]
    llm.generate(
        [{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )

    meter = BusyMeter(runner) if plan.device == "cuda" else None
    try:
        n = plan.headline
        guarded("headline", results)(timed_generate, llm, plan.prompts[:n], plan.output_lens[:n], meter)
        n = plan.compare
        guarded("ours_subset", results)(timed_generate, llm, plan.prompts[:n], plan.output_lens[:n], meter)
        if plan.left() > 90:  # the same without async scheduling: what overlapping the host's work gains
            engine, overlapped = llm.llm_engine, llm.llm_engine.async_scheduling
            engine.async_scheduling = False
            try:
                guarded("ours_subset_sync", results)(timed_generate, llm, plan.prompts[:n], plan.output_lens[:n], meter)
            finally:
                engine.async_scheduling = overlapped
    finally:
        if meter is not None:
            meter.close()


# ---- 3. transformers ---------------------------------------------------------------------


@torch.no_grad()
def run_transformers(model, prompts, output_lens, device: str):
    """One static batch, left-padded; EOS off, so every row runs to the longest output."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    model.generate(ids[:, -8:], attention_mask=mask[:, -8:], max_new_tokens=2, do_sample=False)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max(output_lens), do_sample=False)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert out.shape[1] == width + max(output_lens)
    return dict(seconds=seconds, tokens=sum(output_lens), tok_s=sum(output_lens) / seconds)


# ---- 4. the floor --------------------------------------------------------------------------


def bandwidth_floor(plan: Plan, copy_gbps: float, kv_bytes_per_token: int) -> dict:
    """Bytes every decode step must read (all weights once, plus each live token's K/V),
    summed over the workload, at the copy bandwidth. The first token of each request comes
    from its prefill; decode steps are at least the longest output less one."""
    m = plan.model
    h, q, kv, inter = (
        m["hidden_size"],
        m["num_attention_heads"] * m["head_dim"],
        m["num_key_value_heads"] * m["head_dim"],
        m["intermediate_size"],
    )
    layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h + 2 * m["head_dim"]
    weights = (m["num_hidden_layers"] * layer + h + m["vocab_size"] * h) * plan.dtype.itemsize
    prompts, outs = plan.prompts[: plan.headline], plan.output_lens[: plan.headline]
    steps = max(outs) - 1
    kv_tokens = sum(len(p) * (o - 1) + o * (o - 1) // 2 for p, o in zip(prompts, outs))
    total = steps * weights + kv_tokens * kv_bytes_per_token
    seconds = total / (copy_gbps * 1e9)
    return dict(
        weights=weights,
        kv=kv_tokens * kv_bytes_per_token,
        total=total,
        seconds=seconds,
        tok_s=sum(outs) / seconds,
        copy_gbps=copy_gbps,
    )


def _size(num_bytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes / 1e3:.1f} kB"


# ---- the report ----------------------------------------------------------------------------


def report(plan: Plan, results: dict) -> None:
    section("result")
    rows = []
    e, head, sub, hf, floor = (results.get(k) for k in ("engine", "headline", "ours_subset", "transformers", "floor"))
    kern = results.get("kernels")
    if kern:
        rows.append(("kernels vs torch twins (bf16)", "all within tolerance" if kern["all_ok"] else "SOME FAILED"))
        rows.append(
            (
                "decode attention 256x1024 / copy bandwidth",
                f"{kern['attention_fraction']:.0%} (target {ATTENTION_TARGET:.0%}: "
                f"{'PASS' if kern['attention_fraction'] >= ATTENTION_TARGET else 'FAIL'})",
            )
        )
    if e:
        rows.append(("engine startup (load, profile, graphs)", f"{e['startup_s']:.1f} s, {e['graphs']} decode graphs"))
        rows.append(("KV pool", f"{e['pool_tokens']:,} tokens = {e['num_blocks']:,} blocks, {e['pool_gib']:.1f} GiB"))
    if head:
        n = plan.headline
        rows.append((f"headline: {n} requests, output tokens", f"{head['tokens']:,}"))
        rows.append(("headline: total time", f"{head['seconds']:.2f} s"))
        verdict = f" (target {HEADLINE_TARGET:,}: {'PASS' if head['tok_s'] >= HEADLINE_TARGET else 'FAIL'})"
        rows.append(("headline: output tokens/s", f"{head['tok_s']:,.0f}" + (verdict if plan.device == "cuda" else "")))
        rows.append(("headline: steps, mean batch", f"{head['steps']:,}, {head['mean_batch']:.1f} seqs"))
        busy = head["busy"]
        rows.append(("headline: GPU busy (forward+logits / wall)", "n/a" if busy is None else f"{busy:.0%}"))
    if floor:
        rows.append(
            (
                "bandwidth floor: bytes read by decode",
                f"{_size(floor['total'])} ({_size(floor['kv'])} K/V, weights {_size(floor['weights'])}/step)",
            )
        )
        rows.append(
            (
                "bandwidth floor at copy bandwidth",
                f"{floor['seconds']:.2f} s = {floor['tok_s']:,.0f} tok/s at {floor['copy_gbps']:,.0f} GB/s",
            )
        )
        if head:
            rows.append(("headline vs floor", f"{floor['seconds'] / head['seconds']:.0%} of the bound"))
    n = plan.compare
    if sub:
        rows.append((f"ours on the first {n}", f"{sub['tok_s']:,.0f} tok/s ({sub['seconds']:.2f} s)"))
    sync = results.get("ours_subset_sync")
    if sub and sync:
        on = "async scheduling on" if e and results.get("async_scheduling") else "async scheduling off"
        rows.append(
            (
                f"ours on the first {n}, synchronous steps",
                f"{sync['tok_s']:,.0f} tok/s (the run above, {on}: {sub['tok_s'] / sync['tok_s']:.2f}x)",
            )
        )
    if hf:
        rows.append(
            (f"transformers generate, static batch of {n}", f"{hf['tok_s']:,.0f} tok/s ({hf['seconds']:.2f} s)")
        )
    if sub and hf:
        rows.append((f"ours / transformers on the first {n}", f"{sub['tok_s'] / hf['tok_s']:.1f}x"))
    width = max(len(k) for k, _ in rows) if rows else 10
    print(f"| {'measure':<{width}} | value")
    print(f"|{'-' * (width + 2)}|{'-' * 60}")
    for k, v in rows:
        print(f"| {k:<{width}} | {v}")
    for err in results.get("errors", []):
        print(f"ERROR {err}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 headline requests, transformers on 16")
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny model on CPU (checks the script)")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=480.0,
        help="seconds for the whole run; parts that would overrun are skipped",
    )
    parser.add_argument(
        "--compare-requests", type=int, default=None, help="requests in the transformers comparison (default 64)"
    )
    args = parser.parse_args()
    plan = Plan(args)
    results: dict = {}
    prompt_tokens = sum(map(len, plan.prompts[: plan.headline]))
    print(
        f"workload: {plan.headline} requests, {prompt_tokens:,} prompt tokens, "
        f"{sum(plan.output_lens[: plan.headline]):,} output tokens; engine {plan.engine_kwargs}",
        flush=True,
    )

    section("1. kernels against their torch twins, decode-attention bandwidth")
    kern = guarded("kernels", results)(kernel_checks)
    copy_gbps = kern["copy_gbps"] if kern else guarded("copy_bandwidth", results)(copy_bandwidth_gbps, plan.device)

    section("2. headline workload")
    built = guarded("model", results)(build_model, plan)
    hf_model = None
    if built:
        path, hf_model = built
        guarded("engine_run", results)(run_engine, plan, path, results)
    gc.collect()
    if plan.device == "cuda":
        torch.cuda.empty_cache()

    section("3. transformers generate on the same requests")
    n = plan.compare
    if hf_model is None:
        print("skipped: no model")
    elif plan.left() < (150 if plan.device == "cuda" and n >= 64 else 30):
        print(f"skipped: {plan.left():.0f}s left of the time budget")
    else:
        guarded("transformers", results)(
            run_transformers, hf_model, plan.prompts[:n], plan.output_lens[:n], plan.device
        )

    section("4. bandwidth floor")
    engine = results.get("engine")
    if copy_gbps and engine:
        results["floor"] = bandwidth_floor(plan, copy_gbps, engine["kv_bytes_per_token"])
    else:
        print("skipped: needs the copy bandwidth and the engine's KV layout")
    report(plan, results)


if __name__ == "__main__":
    main()
