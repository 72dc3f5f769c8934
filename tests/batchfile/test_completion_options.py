"""OpenAI's echo, best_of and logit_bias on batch lines: validated per line against OpenAI's ranges,
carried through the shard-input line, run on the engine (a tiny byte-level model) and shaped into
bodies the official openai client parses; checked against the engine's own outputs."""

from __future__ import annotations

import io
import json

import pytest

from batchfile import errors
from batchfile.endpoints.responses import response_body
from batchfile.model_limits import ModelLimits
from batchfile.parser import parse_requests
from batchfile.request import CHAT_URL, COMPLETIONS_URL
from batchfile.sampling import RequestBounds
from batchfile.shard_input import decode_request, encode_request
from batchfile.token_text import token_label
from engine.entrypoints.llm import LLM
from store.results.rows import completed_row

openai = pytest.importorskip("openai")
from openai._models import construct_type  # noqa: E402  (how the client builds its objects)
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def limits(model_dir) -> ModelLimits:
    return ModelLimits.from_dir(model_dir, name="tiny")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=8)


def line(url=COMPLETIONS_URL, **body) -> dict:
    body.setdefault("model", "tiny")
    if url == CHAT_URL:
        body.setdefault("messages", [{"role": "user", "content": "Hello"}])
    else:
        body.setdefault("prompt", PROMPT)
    return {"custom_id": "r1", "method": "POST", "url": url, "body": body}


def parse_one(limits, item):
    (result,) = parse_requests(io.BytesIO(json.dumps(item).encode() + b"\n"), {"tiny": limits})
    return result


def shard_trip(limits, item):
    """The request as a worker reads it back from the shard-input line."""
    parsed = parse_one(limits, item)
    assert not isinstance(parsed, errors.LineError), parsed
    return decode_request(encode_request(parsed))


def run(llm, limits, item) -> tuple:
    request = shard_trip(limits, item)
    (output,) = llm.generate({"prompt_token_ids": request.prompt_token_ids}, request.sampling_params, use_tqdm=False)
    return request, output, response_body(request, output, tokenizer=limits, created=0)


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        (line(logit_bias={"5": 101}), "logit_bias[5] must be a number in [-100, 100]"),
        (line(logit_bias={"5": "up"}), "logit_bias[5] must be a number"),
        (line(logit_bias={"five": 1}), "logit_bias key 'five' is not a token id"),
        (line(logit_bias={"-3": 1}), "logit_bias key '-3' is not a token id"),
        (line(logit_bias=[1]), "logit_bias must be an object"),
        (line(logit_bias={str(i): 1 for i in range(301)}), "at most 300"),
        (line(logit_bias={"512": 1}), "token id 512 is outside the vocabulary [0, 512)"),
        (line(url=CHAT_URL, logit_bias={"99999": -100}), "outside the vocabulary"),
        (line(echo="yes"), "echo must be true or false"),
        (line(url=CHAT_URL, echo=True), "echo=true is not supported"),
        (line(best_of=21), "best_of must be in [n (1), 20], got 21"),
        (line(best_of=2, n=3), "best_of must be in [n (3), 20], got 2"),
        (line(best_of=0), "best_of must be in [n (1), 20], got 0"),
        (line(best_of=1.5), "best_of must be an integer"),
        (line(url=CHAT_URL, best_of=2), "best_of=2 is not supported"),
    ],
)
def test_bad_values_are_clear_line_errors(limits, item, fragment):
    result = parse_one(limits, item)
    assert isinstance(result, errors.LineError), result
    assert result.code == errors.INVALID_PARAMETER or result.code == errors.UNSUPPORTED_PARAMETER
    assert fragment in result.message, result.message


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        (
            line(best_of=20, max_tokens=100),
            "n (20) x max_tokens (100) x (2 + logprobs 0) is 4,000",
        ),  # ranked by logprobs
        (line(echo=True, logprobs=5, prompt="x " * 300, max_tokens=4), "echoed prompt tokens) x (2 + logprobs 5)"),
    ],
)
def test_best_of_and_echoed_prompt_logprobs_count_in_the_output_budget(limits, item, fragment):
    bounds = RequestBounds(max_output_tokens=1000)
    (result,) = parse_requests(io.BytesIO(json.dumps(item).encode() + b"\n"), {"tiny": limits}, bounds=bounds)
    assert isinstance(result, errors.LineError) and result.code == errors.OUTPUT_BUDGET_EXCEEDED, result
    assert fragment in result.message, result.message


def test_fields_travel_in_the_shard_line(limits):
    request = shard_trip(
        limits, line(echo=True, logprobs=2, best_of=3, n=2, temperature=0.7, logit_bias={"7": -100, "9": 2.5})
    )
    sp = request.sampling_params
    assert (sp.n, sp.logprobs, sp.prompt_logprobs, sp.logit_bias) == (3, 2, 2, {7: -100.0, 9: 2.5})
    assert request.options == {"echo": PROMPT, "best_of": 2}
    quiet = shard_trip(limits, line(best_of=4, temperature=1.0)).sampling_params
    assert (quiet.n, quiet.logprobs) == (4, 0)  # logprobs only to rank the candidates
    greedy = shard_trip(limits, line(best_of=4, temperature=0))
    assert greedy.sampling_params.n == 1 and greedy.options == {}  # every candidate would be the same
    plain = shard_trip(limits, line(echo=False, best_of=1, logit_bias={}))
    assert plain.options == {} and plain.sampling_params.logit_bias is None


def test_echo_with_logprobs_prepends_the_prompt_and_its_logprobs(llm, limits):
    request, output, body = run(llm, limits, line(echo=True, logprobs=3, max_tokens=6, temperature=0))
    completion = construct_type(type_=Completion, value=body)
    choice = completion.choices[0]
    generated = output.outputs[0]
    assert choice.text == PROMPT + generated.text
    lp = choice.logprobs
    n_prompt = len(output.prompt_token_ids)
    assert len(lp.tokens) == n_prompt + len(generated.token_ids)
    ids = list(output.prompt_token_ids) + list(generated.token_ids)
    assert lp.tokens == [token_label(limits, t) for t in ids]  # each token's own text, as OpenAI
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts it (OpenAI: null)
    for i in range(1, n_prompt):
        entry = output.prompt_logprobs[i][output.prompt_token_ids[i]]
        assert lp.token_logprobs[i] == pytest.approx(entry.logprob)
        assert 3 <= len(lp.top_logprobs[i]) <= 4
        assert max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i]
    for j, token in enumerate(generated.token_ids):
        assert lp.token_logprobs[n_prompt + j] == pytest.approx(generated.logprobs[j][token].logprob)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert body["usage"]["prompt_tokens"] == n_prompt


def test_echo_without_logprobs_and_of_a_token_prompt(llm, limits):
    ids = limits.tokenizer.encode(" jumps over", add_special_tokens=False)
    _, output, body = run(llm, limits, line(echo=True, prompt=ids, max_tokens=3, temperature=0))
    Completion.model_validate(body)
    choice = body["choices"][0]
    assert choice["text"] == " jumps over" + output.outputs[0].text and choice["logprobs"] is None


@pytest.mark.parametrize("url", [COMPLETIONS_URL, CHAT_URL])
def test_logit_bias_steers_greedy_decoding(llm, limits, url):
    _, plain, _ = run(llm, limits, line(url=url, max_tokens=4, temperature=0))
    first = plain.outputs[0].token_ids[0]
    _, banned, body = run(llm, limits, line(url=url, max_tokens=4, temperature=0, logit_bias={str(first): -100}))
    assert first not in banned.outputs[0].token_ids
    forced_id = limits.tokenizer.encode("Z", add_special_tokens=False)[0]
    _, forced, body = run(
        llm, limits, line(url=url, max_tokens=4, temperature=0, ignore_eos=True, logit_bias={str(forced_id): 100})
    )
    assert forced.outputs[0].token_ids == [forced_id] * 4
    (ChatCompletion if url == CHAT_URL else Completion).model_validate(body)


def test_best_of_returns_the_candidates_with_the_best_logprob_per_token(llm, limits):
    item = line(best_of=4, n=2, temperature=1.0, seed=13, max_tokens=8, stop=["o"])
    request, output, body = run(llm, limits, item)
    Completion.model_validate(body)
    candidates = output.outputs
    assert len(candidates) == 4 and len({tuple(c.token_ids) for c in candidates}) > 1
    per_token = sorted(candidates, key=lambda c: -c.cumulative_logprob / len(c.token_ids))
    by_sum = sorted(candidates, key=lambda c: -c.cumulative_logprob)
    assert {c.index for c in per_token[:2]} != {c.index for c in by_sum[:2]}  # the seed tells the rules apart
    assert [c["text"] for c in body["choices"]] == [c.text for c in per_token[:2]]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in body["choices"])  # not asked for
    assert body["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in candidates)
    row = completed_row(request, output, tokenizer=limits)  # the result row's own columns agree
    assert row["output_text"] == per_token[0].text and row["completion_tokens"] == body["usage"]["completion_tokens"]
    _, _, with_logprobs = run(llm, limits, {**item, "body": {**item["body"], "logprobs": 1}})
    assert [c["text"] for c in with_logprobs["choices"]] == [c["text"] for c in body["choices"]]
    assert all(c["logprobs"]["token_logprobs"] for c in with_logprobs["choices"])
