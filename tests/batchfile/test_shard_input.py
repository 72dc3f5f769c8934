"""Shard-input lines read back by a worker: lines with equal sampling parameters share one `SamplingParams`."""

from __future__ import annotations

import io
import json

import pytest

from batchfile.model_limits import ModelLimits
from batchfile.parser import parse_requests
from batchfile.shard_input import decode_request, encode_request


@pytest.fixture(scope="module")
def limits(tiny_model) -> ModelLimits:
    return ModelLimits.from_dir(tiny_model("qwen3"), name="tiny")


def shard_lines(limits, bodies) -> list[str]:
    text = "".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n"
        for i, body in enumerate(bodies)
    )
    return [encode_request(item) for item in parse_requests(io.BytesIO(text.encode()), {"tiny": limits})]


def test_lines_with_equal_parameters_share_them_and_others_do_not(limits):
    greedy = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
    bodies = [
        greedy,
        {**greedy, "prompt": "Another prompt"},
        {**greedy, "max_tokens": 6},
        {**greedy, "stop": ["\n", "."], "seed": 7, "temperature": 0.8},
        {**greedy, "prompt": "More", "stop": ["\n", "."], "seed": 7, "temperature": 0.8},
        {**greedy, "stop": ["."], "seed": 7, "temperature": 0.8},
    ]
    lines = shard_lines(limits, bodies)
    shared: dict = {}
    cached = [decode_request(line, shared) for line in lines]
    alone = [decode_request(line) for line in lines]
    for a, b in zip(cached, alone):
        assert vars(a.sampling_params) == vars(b.sampling_params)
        assert a.prompt_token_ids == b.prompt_token_ids and a.custom_id == b.custom_id
    same = [[cached[i].sampling_params is cached[j].sampling_params for j in range(6)] for i in range(6)]
    assert same[0][1] and same[3][4]  # equal parameters, different prompts: one object
    assert not any(same[0][j] for j in (2, 3, 5)) and not same[3][5] and not same[2][5]
    assert len(shared) == 4
    assert alone[0].sampling_params is not alone[1].sampling_params  # no cache: one object per line
