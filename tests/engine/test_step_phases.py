"""Each phase of one engine step on its own (engine.core.step_phases), on a tiny random model:
a prompt chunked over two steps, then sampled greedily; and the phases run by hand give the same
tokens as `LLMEngine.step`."""

from __future__ import annotations

import pytest
import torch

from engine.core import step_phases as phases
from engine.core.llm_engine import LLMEngine
from engine.params.sampling_params import SamplingParams

PROMPT = {"prompt_token_ids": list(range(3, 15))}  # 12 tokens: one chunk of 8, then 4


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return str(tiny_model("qwen3"))


def _engine(path: str) -> LLMEngine:
    return LLMEngine(model=path, max_num_batched_tokens=8, max_num_seqs=4, dtype="float32", device="cpu")


def test_nothing_to_schedule_is_a_result_without_a_batch(model_path):
    assert phases.schedule(_engine(model_path)) == phases.ScheduleResult(None, [])


def test_a_chunked_prompt_through_each_phase(model_path):
    engine = _engine(model_path)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=2, temperature=0, logprobs=1))

    scheduled = phases.schedule(engine)  # the first chunk: the budget's 8 tokens, nothing sampled yet
    (seq,) = scheduled.batch.seqs
    assert scheduled.batch.num_new_tokens == [8] and scheduled.finished == []
    inputs = phases.build_inputs(scheduled)
    assert inputs.samplers == [] and not inputs.pooling and inputs.prompt_logprob_spans == []
    outputs = phases.run_model(engine, inputs)
    assert outputs.logits.shape[0] == 0 and outputs.hidden is None
    sampled = phases.sample(engine, inputs, outputs)
    assert sampled == phases.SampledTokens([], None)
    result = phases.update(engine, inputs, sampled)
    assert (seq.num_computed_tokens, len(seq), result.finished, result.num_tokens) == (8, 12, [], 8)

    inputs = phases.build_inputs(phases.schedule(engine))  # the rest of the prompt: its last token samples
    assert inputs.batch.num_new_tokens == [4] and inputs.samplers == [seq]
    outputs = phases.run_model(engine, inputs)
    assert outputs.logits.shape == (1, engine.model_config.vocab_size)
    sampled = phases.sample(engine, inputs, outputs)
    assert sampled.tokens == [int(torch.argmax(outputs.logits[0]))]  # greedy
    assert sampled.logprobs[0].token_id == sampled.tokens[0]
    result = phases.update(engine, inputs, sampled)
    assert seq.output_token_ids == sampled.tokens and seq.num_computed_tokens == 12
    assert list(seq.logprobs[0])[0] == sampled.tokens[0] and result.finished == []

    inputs = phases.build_inputs(phases.schedule(engine))  # one decode token, then max_tokens ends it
    result = phases.update(engine, inputs, phases.sample(engine, inputs, phases.run_model(engine, inputs)))
    (output,) = result.finished
    assert output.request_id == "r" and output.outputs[0].token_ids == seq.output_token_ids
    assert output.outputs[0].finish_reason == "length" and not engine.has_unfinished_requests()


def _by_phases(engine: LLMEngine) -> list:
    finished = []
    while engine.has_unfinished_requests():
        scheduled = phases.schedule(engine)
        finished += scheduled.finished
        if scheduled.batch is not None:
            inputs = phases.build_inputs(scheduled)
            sampled = phases.sample(engine, inputs, phases.run_model(engine, inputs))
            finished += phases.update(engine, inputs, sampled).finished
    return finished


def _by_step(engine: LLMEngine) -> list:
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    return finished


def test_the_phases_by_hand_are_the_step(model_path):
    tokens = []
    for drive in (_by_step, _by_phases):
        engine = _engine(model_path)
        for i in range(3):
            prompt = {"prompt_token_ids": list(range(3 + i, 20 + 2 * i))}
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=5, temperature=1.0, seed=i, n=1 + i % 2))
        outputs = sorted(drive(engine), key=lambda o: o.request_id)
        tokens.append([[c.token_ids for c in o.outputs] for o in outputs])
    assert tokens[0] == tokens[1] and len(tokens[0]) == 3
