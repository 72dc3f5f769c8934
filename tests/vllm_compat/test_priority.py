"""vLLM's `scheduling_policy="priority"`: waiting requests are admitted by (priority, arrival), a lower value
first, and when the KV pool runs dry the worst-ranked running request (highest value, latest arrival) is the
one preempted. Under the default "fcfs" any integer priority is accepted and changes nothing, as in vLLM V1."""

from __future__ import annotations

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.exceptions import VLLMValidationError
from tests.helpers import assert_pool_free


def test_waiting_requests_run_lowest_priority_value_first_then_oldest(model_dir):
    llm = LLM(
        str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority"
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": [7, 8, 9 + i]} for i in range(5)]
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=[3, 1, -2, 1, 3])
    finish_order = sorted(range(5), key=lambda i: outputs[i].metrics["finished_time"])
    assert finish_order == [2, 1, 3, 0, 4]  # one at a time: -2, then the 1s and the 3s in arrival order
    fcfs = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=1)
    same = fcfs.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in same]
    assert_pool_free(llm.llm_engine)


def _preemptions(model_dir, policy: str, priorities: dict[str, int]) -> tuple[list[str], dict]:
    """Three requests that outgrow a 6-block pool together; the ids preempted, in order, and the outputs."""
    engine = LLMEngine(
        str(model_dir), device="cpu", dtype="float32", num_kv_blocks=6, block_size=16, scheduling_policy=policy
    )
    victims = []
    preempt = engine.scheduler._preempt

    def recording_preempt(seq):
        victims.append(seq.request_id)
        preempt(seq)

    engine.scheduler._preempt = recording_preempt
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, (request_id, priority) in enumerate(priorities.items()):  # added oldest first
        engine.add_request(request_id, {"prompt_token_ids": [3 + i] * 15}, params, priority=priority)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step())
    assert_pool_free(engine)
    return victims, outputs


def test_the_worst_ranked_running_request_is_preempted(model_dir):
    fcfs_victims, fcfs_out = _preemptions(model_dir, "fcfs", {"old": 0, "mid": 0, "new": 0})
    assert fcfs_victims and fcfs_victims[0] == "new"  # first come first served: the newest goes
    victims, outputs = _preemptions(model_dir, "priority", {"old": 5, "mid": 0, "new": 1})
    assert victims and victims[0] == "old"  # the highest value, although it is the oldest
    assert "mid" not in victims  # the best-ranked request always keeps its blocks
    assert outputs == fcfs_out  # recomputed after preemption: the same greedy tokens
    ties, _ = _preemptions(model_dir, "priority", {"old": 1, "mid": 1, "new": 1})
    assert ties[0] == "new"  # equal priorities: the latest arrival goes


def test_fcfs_ignores_priority_and_priority_must_be_an_integer(model_dir):
    engine = LLMEngine(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=8)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    engine.add_request("a", {"prompt_token_ids": [1, 2]}, params, priority=1)  # vLLM V1: accepted under fcfs
    engine.add_request("b", {"prompt_token_ids": [1, 2]}, params, priority=-5)
    assert [s.request_id for s in (engine._incoming[0].seqs[0], engine._incoming[1].seqs[0])] == ["a", "b"]
    engine.abort_request("a")
    engine.abort_request("b")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=8, scheduling_policy="priority")
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate(["a"], params, use_tqdm=False, priority=[1.5])
    with pytest.raises(VLLMValidationError, match=r"prompts \(2\) and priority \(1\) must be the same"):
        llm.generate(["a", "b"], params, use_tqdm=False, priority=[1])
    assert not llm.llm_engine.has_unfinished_requests()  # nothing half done
