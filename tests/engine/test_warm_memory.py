"""engine.runner.warm_up.warm_memory: the CPU engine runs one step of its full token budget at load, so that
the first real step of that size finds its memory mapped instead of faulting it in."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

GLIBC = "glibc" in (os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else "").lower()

# Loads an engine (warm_memory on or off), then prints the page faults of its first 4,096-token step.
FIRST_STEP_FAULTS = """
import resource, sys
import engine.runner.model_runner as runner
from engine import LLM, SamplingParams
from engine.testing.tiny import write_tiny_model
if sys.argv[2] == "off":
    runner.warm_memory = lambda *args, **kwargs: 0
path = write_tiny_model(sys.argv[1], "llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
llm = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=4096, num_kv_blocks=600)
prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 400 for j in range(1024)]} for i in range(4)]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _first_step_faults(tmp_path, mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", FIRST_STEP_FAULTS, str(tmp_path / mode), mode],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(out[-1])


@pytest.mark.skipif(not GLIBC, reason="kept memory is glibc's setting")
def test_the_first_full_step_faults_in_far_fewer_pages_after_the_warm_up(tmp_path):
    warm, cold = _first_step_faults(tmp_path, "on"), _first_step_faults(tmp_path, "off")
    # 4,096 tokens x 2,048 MLP floats alone are 32 MiB: 8,192 pages
    assert cold > 8_000 and warm < cold / 4, (warm, cold)


def test_the_warm_step_spans_prompts_no_longer_than_the_context(tiny_model):
    from engine import LLM
    from engine.runner.warm_up import warm_memory

    llm = LLM(str(tiny_model("llama")), device="cpu", max_model_len=256, max_num_batched_tokens=600, num_kv_blocks=64)
    runner = llm.llm_engine.runner
    assert (
        warm_memory(runner.model, runner.model_config, runner.block_size, runner.device, runner.dtype, 600, 16) == 600
    )
