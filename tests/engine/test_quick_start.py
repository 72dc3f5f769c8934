"""A quick start (`pagedbatch_kernels.startup`): nothing compiled or timed before the first step, the native
library built off the critical path, and the same tokens as transformers (greedy float32) with prefix caching,
chunked prefill and preemption."""

from __future__ import annotations

import argparse
import subprocess
import types
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from pagedbatch.commands import engine_commands
from pagedbatch_kernels import startup
from pagedbatch_kernels.cpu import cpu_native
from tests.helpers import assert_pool_free, assert_same, make_prompts, reference


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setenv(startup.ENV, "quick")


def test_quick_start_compiles_nothing_and_matches_transformers(quick, tiny_model, monkeypatch):
    compiles = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiles.append(fn) or fn)
    path = tiny_model("qwen3")
    prompts, max_tokens = make_prompts(seed=3, count=12, shared_prefixes=True)
    # a small pool and token budget: chunked prefill, shared prefix blocks and preemption all happen
    llm = LLM(str(path), num_kv_blocks=40, max_num_batched_tokens=64)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens],
    )
    assert_same([list(o.outputs[0].token_ids) for o in outs], reference(path, prompts, max_tokens))
    assert_pool_free(llm.llm_engine)
    assert compiles == []  # (full start: every kernel at load)


def test_a_missing_native_library_is_built_by_a_detached_process(quick, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    started = []
    monkeypatch.setattr(cpu_native, "build_detached", lambda: started.append(True))
    assert cpu_native._built_now_or_later() is None  # torch's kernels for this process
    assert started == [True] and not cpu_native.library_path().exists()


def test_the_detached_builder_outlives_its_parent(monkeypatch):
    launched = []
    fake = types.SimpleNamespace(**vars(subprocess))
    fake.Popen = lambda cmd, **kwargs: launched.append((cmd, kwargs))
    monkeypatch.setattr(cpu_native, "subprocess", fake)
    cpu_native.build_detached()
    ((cmd, kwargs),) = launched
    assert cmd[-1].endswith("build()") and kwargs["start_new_session"] is True
    assert "os.nice(19)" in cmd[-1]  # it takes no CPU from the job that started it
    assert str(Path(cpu_native.__file__).resolve().parent.parent) in kwargs["env"]["PYTHONPATH"]


@pytest.mark.parametrize(
    ("lines", "flag", "env", "expected"),
    [
        (5, "auto", None, "quick"),
        (engine_commands.QUICK_START_LINES + 1, "auto", None, "full"),
        (5, "full", None, "full"),
        (5, "auto", "full", "full"),
        (1000, "quick", None, "quick"),
    ],
)
def test_run_picks_the_start_by_the_file(lines, flag, env, expected, tmp_path, monkeypatch):
    monkeypatch.delenv(startup.ENV, raising=False)
    if env:
        monkeypatch.setenv(startup.ENV, env)
    path = tmp_path / "in.jsonl"
    path.write_text("{}\n" * lines)
    engine_commands._choose_startup(argparse.Namespace(startup=flag, input=str(path)))
    assert startup.mode() == expected
