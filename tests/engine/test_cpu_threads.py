"""The CPU step's thread count (`engine.runner.cpu_threads`): a small step runs on one thread; a
step whose process got less than its threads' share of the host puts the next steps on one thread, then
all threads are tried again; a step that got its share keeps them; `cpu_threads=all` never drops them
for a step that is not small."""

import pytest
import torch

from engine.runner import cpu_threads
from engine.runner.cpu_threads import PROBE_STEPS, StepThreads


@pytest.fixture
def clock(monkeypatch):
    """A fake wall clock and process CPU clock that each step advances by (wall, cpu)."""
    now = {"wall": 0.0, "cpu": 0.0}
    monkeypatch.setattr(cpu_threads.time, "perf_counter", lambda: now["wall"])
    monkeypatch.setattr(cpu_threads.time, "process_time", lambda: now["cpu"])

    def advance(wall, cpu):
        now["wall"] += wall
        now["cpu"] += cpu

    return advance


def _steps(threads: StepThreads, advance, count: int, share: float) -> list[int]:
    seen = []
    for _ in range(count):
        with threads.step():
            seen.append(torch.get_num_threads())
            advance(0.05, 0.05 * share * threads.threads)
    return seen


def test_a_busy_host_puts_steps_on_one_thread_then_probes_again(clock, monkeypatch):
    monkeypatch.setenv("PAGEDBATCH_CPU_THREADS", "auto")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = StepThreads()
        assert _steps(threads, clock, 3, share=1.0) == [2, 2, 2]  # the host gives both cores: both kept
        seen = _steps(threads, clock, PROBE_STEPS + 2, share=0.3)  # a thread descheduled: 30 % of the time
        assert seen == [2] + [1] * PROBE_STEPS + [2]
        assert torch.get_num_threads() == 2  # restored after each one-thread step
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("setting", ["all", None])  # None: the default
def test_all_keeps_every_thread(clock, monkeypatch, setting):
    if setting:
        monkeypatch.setenv("PAGEDBATCH_CPU_THREADS", setting)
    else:
        monkeypatch.delenv("PAGEDBATCH_CPU_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _steps(StepThreads(), clock, 5, share=0.1) == [2] * 5
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("setting", ["all", "auto"])
def test_a_small_step_runs_on_one_thread(clock, monkeypatch, setting):
    """Under SMALL_STEP_MACS (new tokens times the model's weights) one thread, whatever the setting and
    the host's load; a larger step, or a step of unknown size, keeps every thread."""
    monkeypatch.setenv("PAGEDBATCH_CPU_THREADS", setting)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = StepThreads(macs_per_token=1000)
        seen = []
        small = cpu_threads.SMALL_STEP_MACS // 1000  # the most tokens under the mark
        for tokens in (1, small, small + 1, 0):
            with threads.step(tokens):
                seen.append(torch.get_num_threads())
                clock(0.05, 0.1)  # the host gives both cores
        assert seen == [1, 1, 2, 2]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_steps_size_counts_the_linear_layers_and_every_expert():
    """A token's weights for the small-step rule: each linear layer's in x out, and all of an MoE
    layer's experts (a decode step of a few tokens reads most of them), not only the k it routes to."""
    from torch import nn

    from engine.models.moe import Experts
    from engine.runner.model_runner import _matmul_weights

    model = nn.Sequential(nn.Linear(4, 8), Experts(num_experts=3, hidden=4, intermediate=5, ops=None))
    assert _matmul_weights(model) == 4 * 8 + 3 * (2 * 5 * 4) + 3 * (4 * 5)


def test_a_steps_size_counts_the_kv_cache_its_attention_reads(clock, monkeypatch):
    """Each position the step's rows attend to reads kv_per_position elements of the pool, counted at
    KV_READ_MACS each: a decode step over long contexts keeps every thread however small the model."""
    monkeypatch.setenv("PAGEDBATCH_CPU_THREADS", "all")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = StepThreads(macs_per_token=1000, kv_per_position=128)
        tokens = cpu_threads.SMALL_STEP_MACS // 1000 // 2  # half the mark in weights
        room = (cpu_threads.SMALL_STEP_MACS - tokens * 1000) // (128 * cpu_threads.KV_READ_MACS)
        seen = []
        for context in (1, room - 1, room + 1):
            with threads.step(tokens, context):
                seen.append(torch.get_num_threads())
        assert seen == [1, 1, 2]
    finally:
        torch.set_num_threads(before)


def test_the_runner_counts_every_layers_kv_per_position(tmp_path):
    from engine import LLM
    from engine.testing.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "m", "llama", num_hidden_layers=2, num_key_value_heads=2, head_dim=16)
    runner = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16).llm_engine.runner
    assert runner.step_threads.kv_per_position == 2 * 2 * 2 * 16  # K and V, layers, KV heads, head size
