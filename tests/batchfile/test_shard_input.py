"""Lines with equal sampling parameters share one `SamplingParams`: shard-input lines read back by a worker, and
lines being validated (where a chat line without max_tokens still gets its own)."""

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


def parsed(limits, bodies, url="/v1/completions"):
    text = "".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}) + "\n"
        for i, body in enumerate(bodies)
    )
    return list(parse_requests(io.BytesIO(text.encode()), {"tiny": limits}))


def test_validation_shares_equal_parameters_and_gives_each_chat_default_its_own(limits):
    greedy = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
    items = parsed(limits, [greedy, {**greedy, "prompt": "Another"}, {**greedy, "max_tokens": 1.0}])
    assert items[0].sampling_params is items[1].sampling_params  # equal fields: one checked object
    assert items[0].sampling_params.max_tokens == 5
    assert getattr(items[2], "code", None) == "invalid_parameter"  # 1.0 is not the integer 1: not shared with it
    chat = {"model": "tiny", "temperature": 0}
    short, long = [{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Hello there " * 20}]
    a, b, c = parsed(
        limits,
        [{**chat, "messages": short}, {**chat, "messages": long}, {**chat, "messages": short}],
        url="/v1/chat/completions",
    )
    # no max_tokens: each line gets the rest of the context after its own prompt, on its own copy
    room = limits.max_model_len
    assert a.sampling_params.max_tokens == room - len(a.prompt_token_ids)
    assert b.sampling_params.max_tokens == room - len(b.prompt_token_ids) < a.sampling_params.max_tokens
    assert c.sampling_params.max_tokens == a.sampling_params.max_tokens
    assert a.sampling_params is not b.sampling_params


def test_bad_parameters_fail_every_line_that_has_them(limits):
    bad = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 7}
    items = parsed(limits, [bad, {**bad, "prompt": "Again"}, {**bad, "temperature": 0}])
    assert [getattr(item, "code", None) for item in items] == ["invalid_parameter", "invalid_parameter", None]
