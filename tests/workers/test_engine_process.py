"""EngineProcess: the worker's engine host in a child process, with the same calls and futures as EngineHost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engine import LLMEngine, SamplingParams
from tests.helpers import REPO, engine_greedy, process_alive, wait_until
from workers.host.engine_process import EngineProcess
from workers.metrics.series import WorkerMetrics


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return str(tiny_model("qwen3"))


@pytest.fixture(scope="module")
def host(model_path):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PAGEDBATCH_STARTUP", "deferred")  # the child inherits it: no compiling for these few steps
        host = EngineProcess(None, model_path, {"max_num_seqs": 8})
    yield host
    host.close()


def test_results_are_those_of_the_engine_in_this_process(host, model_path):
    assert host.engine_pid != os.getpid()
    metrics = WorkerMetrics("tiny")
    host.observer = metrics
    try:
        requests = [(f"r{i}", {"prompt_token_ids": [1 + i, 2, 3 + i]}, _greedy(3 + i % 4)) for i in range(12)]
        futures = host.submit_many(requests, tenant="t1")
        outputs = [f.result(timeout=120) for f in futures]
    finally:
        host.observer = None
    expected = engine_greedy(model_path, requests)
    assert {o.request_id: o.outputs[0].token_ids for o in outputs} == expected
    assert host.pending() == 0
    assert host.tokenizer.decode([5, 6, 7]) == LLMEngine(model=model_path).decoding_tokenizer.decode([5, 6, 7])
    # the metrics and the heartbeat see the child's steps
    assert metrics.requests_finished._value.get() == 12
    assert metrics.generation_tokens._value.get() == sum(len(t) for t in expected.values())
    assert metrics.step_seconds._sum.get() > 0
    load = host.engine.load()
    assert load.running == 0 and load.blocks_free == load.blocks_total
    assert host.rates.snapshot(), "no step rates measured"


def test_bad_input_fails_alone_abort_resolves_none_and_ids_stay_unique(host):
    good, bad, gone = host.submit_many(
        [
            ("good", {"prompt_token_ids": [1, 2, 3]}, _greedy(4)),
            ("bad", {"prompt_token_ids": [1, 10**9]}, _greedy(4)),
            ("gone", {"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=10_000, ignore_eos=True)),
        ]
    )
    with pytest.raises(ValueError, match="already running"):
        host.submit_many([("gone", {"prompt_token_ids": [1]}, _greedy(1))])
    assert host.abort(["gone", "never-submitted"]) == 1
    assert gone.result(timeout=60) is None
    with pytest.raises(ValueError, match="out of vocabulary"):
        bad.result(timeout=60)
    assert len(good.result(timeout=60).outputs[0].token_ids) == 4
    deadline = time.monotonic() + 30
    while host.engine.load().running and time.monotonic() < deadline:  # the child freed the aborted one
        host.submit_many([(f"tick{time.monotonic()}", {"prompt_token_ids": [1]}, _greedy(1))])[0].result(timeout=60)
    assert host.engine.load().running == 0


def test_a_failed_load_is_raised_to_the_caller(tmp_path):
    with pytest.raises(Exception) as excinfo:
        EngineProcess(None, str(tmp_path / "no-such-model"), {})
    assert "no-such-model" in str(excinfo.value)


def _script(model_path: str, body: str) -> list[str]:
    code = textwrap.dedent(
        f"""
        import os, signal, sys, time
        from workers.host.engine_process import EngineProcess
        host = EngineProcess(None, {model_path!r}, {{"max_num_seqs": 4}})
        print(host.engine_pid, flush=True)
        """
    )
    return [sys.executable, "-c", code + textwrap.dedent(body)]


def test_a_worker_whose_engine_process_dies_ends_too(model_path):
    env = {**os.environ, "PAGEDBATCH_STARTUP": "deferred"}
    body = "os.kill(host.engine_pid, signal.SIGKILL)\ntime.sleep(60)\nprint('still here')\n"
    proc = subprocess.run(_script(model_path, body), cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 70, proc.stderr[-2000:]
    assert "still here" not in proc.stdout
    assert "the engine process ended" in proc.stderr


def test_the_engine_process_ends_with_its_worker(model_path):
    env = {**os.environ, "PAGEDBATCH_STARTUP": "deferred"}
    worker = subprocess.Popen(
        _script(model_path, "time.sleep(120)\n"), cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        engine_pid = int(worker.stdout.readline())
        assert process_alive(engine_pid)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        wait_until(lambda: not process_alive(engine_pid), timeout=30, what="the engine process to end")
    finally:
        worker.kill()
