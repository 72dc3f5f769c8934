"""OpenAI-batch request lines (batchfile): parsing, validation, limits and the OpenAI response shapes."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchfile import errors
from batchfile.endpoints.responses import (
    batch_error_line,
    batch_output_line,
    chat_completion_body,
    response_body,
    text_completion_body,
)
from batchfile.errors import InputTooLarge, LineError
from batchfile.lines import LineCount, count_lines
from batchfile.model_limits import ModelLimits, UnknownModel, limits_by_name, limits_of
from batchfile.parser import parse_requests
from batchfile.request import CHAT_URL, COMPLETIONS_URL, ParsedRequest
from batchfile.sampling import DEFAULT_COMPLETIONS_MAX_TOKENS
from engine.hf.config import ModelConfig
from engine.hf.model_info import context_length
from engine.hf.tokenizer import encode_chat
from engine.params.outputs import CompletionOutput, Logprob, RequestOutput
from engine.testing.tiny import write_tiny_model

CHAT, COMPLETIONS = CHAT_URL, COMPLETIONS_URL


@pytest.fixture(scope="module")
def limits(tmp_path_factory) -> ModelLimits:
    path = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", arch="qwen3")
    return ModelLimits.from_dir(path, name="tiny")


def line(custom_id="r1", url=CHAT, method="POST", **body) -> dict:
    if "messages" not in body and "prompt" not in body:
        if url == CHAT:
            body["messages"] = [{"role": "user", "content": "Hello, world!"}]
        else:
            body["prompt"] = "The quick brown fox"
    body.setdefault("model", "tiny")
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def jsonl(*items) -> bytes:
    return b"".join((i if isinstance(i, bytes) else json.dumps(i).encode()) + b"\n" for i in items)


def parse(limits, *items, models=None, **kwargs) -> list:
    return list(parse_requests(io.BytesIO(jsonl(*items)), models or {"tiny": limits}, **kwargs))


def one(limits, item, **kwargs):
    (result,) = parse(limits, item, **kwargs)
    return result


def error(limits, item, **kwargs) -> LineError:
    result = one(limits, item, **kwargs)
    assert isinstance(result, LineError), result
    return result


# ---- valid lines ---------------------------------------------------------------------------------


def test_chat_line_tokenizes_like_the_chat_template(limits):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    req = one(limits, line(messages=messages, max_tokens=7))
    tok = limits.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert req.prompt_token_ids == tok(text, add_special_tokens=False).input_ids
    assert (req.line, req.custom_id, req.url, req.model) == (1, "r1", CHAT, "tiny")
    assert req.sampling_params.max_tokens == 7
    assert req.body["messages"] == messages


def test_completion_prompts(limits):
    tok = limits.tokenizer
    text = one(limits, line(url=COMPLETIONS, prompt="The quick brown fox"))
    assert text.prompt_token_ids == tok("The quick brown fox").input_ids
    assert text.sampling_params.max_tokens == DEFAULT_COMPLETIONS_MAX_TOKENS
    assert one(limits, line(url=COMPLETIONS, prompt=[5, 6, 7])).prompt_token_ids == [5, 6, 7]
    assert one(limits, line(url=COMPLETIONS, prompt=["Hello"])).prompt_token_ids == tok("Hello").input_ids
    assert one(limits, line(url=COMPLETIONS, prompt=[[9, 8]])).prompt_token_ids == [9, 8]


def test_sampling_fields_map_to_sampling_params(limits):
    req = one(
        limits,
        line(
            max_completion_tokens=20,
            temperature=0.5,
            top_p=0.9,
            n=3,
            stop="END",
            seed=42,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            logprobs=True,
            top_logprobs=4,
            top_k=40,
            min_p=0.05,
            min_tokens=2,
            repetition_penalty=1.1,
            ignore_eos=True,
            stop_token_ids=[7],
            skip_special_tokens=False,
            user="u1",
            stream=False,
            metadata={"a": "b"},
            store=False,
        ),
    )
    sp = req.sampling_params
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.n, sp.stop_strings, sp.seed) == (
        20,
        0.5,
        0.9,
        3,
        ["END"],
        42,
    )
    assert (sp.presence_penalty, sp.frequency_penalty, sp.logprobs, sp.top_k, sp.min_p) == (
        0.5,
        -0.5,
        4,
        40,
        0.05,
    )
    assert (sp.min_tokens, sp.repetition_penalty, sp.ignore_eos, sp.stop_token_ids) == (2, 1.1, True, [7])
    assert sp.skip_special_tokens is False
    completion = one(limits, line(url=COMPLETIONS, logprobs=3, stop=["a", "b"]))
    assert completion.sampling_params.logprobs == 3 and completion.sampling_params.stop_strings == ["a", "b"]
    assert one(limits, line(logprobs=True)).sampling_params.logprobs == 0
    assert one(limits, line(logprobs=False)).sampling_params.logprobs is None


def test_chat_default_max_tokens_fills_the_context(limits):
    req = one(limits, line())
    assert req.sampling_params.max_tokens == limits.max_model_len - len(req.prompt_token_ids)


def test_content_parts_roles_and_template_kwargs(limits):
    parts = [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "world!"}]
    a = one(limits, line(messages=[{"role": "developer", "content": "Sys"}, {"role": "user", "content": parts}]))
    b = one(
        limits,
        line(messages=[{"role": "system", "content": "Sys"}, {"role": "user", "content": "Hello,\nworld!"}]),
    )
    assert a.prompt_token_ids == b.prompt_token_ids
    c = one(limits, line(chat_template_kwargs={"enable_thinking": False}))
    assert c.prompt_token_ids == one(limits, line()).prompt_token_ids  # the tiny template ignores it


def test_defaults_merge_under_the_line(limits):
    defaults = {"max_tokens": 11, "temperature": 0.0}
    a, b, c = parse(limits, line("a"), line("b", max_tokens=5), line("c", max_completion_tokens=6), defaults=defaults)
    assert (a.sampling_params.max_tokens, a.sampling_params.temperature) == (11, 0.0)
    assert b.sampling_params.max_tokens == 5
    assert c.sampling_params.max_tokens == 6
    assert a.body == line("a")["body"]  # the body as uploaded


def test_forced_model_ignores_body_model(limits):
    (req,) = parse(limits, line(model="gpt-4o-mini"), models=limits)
    assert req.model == "tiny"
    body = line()["body"]
    del body["model"]
    (req,) = parse(limits, {"custom_id": "x", "method": "POST", "url": CHAT, "body": body}, models=limits)
    assert isinstance(req, ParsedRequest)


def test_blank_lines_crlf_bom_and_line_numbers(limits):
    data = (
        b"\xef\xbb\xbf"
        + json.dumps(line("a")).encode()
        + b"\r\n\r\n   \n"
        + json.dumps(line("b")).encode()
        + b"\n\nnot json\n"
        + json.dumps(line("c")).encode()
    )
    results = list(parse_requests(io.BytesIO(data), {"tiny": limits}))
    assert [r.line for r in results] == [1, 4, 6, 7]
    assert [type(r).__name__ for r in results] == [
        "ParsedRequest",
        "ParsedRequest",
        "LineError",
        "ParsedRequest",
    ]
    assert results[2].code == errors.INVALID_JSON


# ---- errors --------------------------------------------------------------------------------------

BAD_LINES = [
    (b"\xff\xfe{}", errors.INVALID_UTF8, "UTF-8"),
    (b'{"custom_id": "x",', errors.INVALID_JSON, "JSON"),
    (b'{"custom_id": "x", "n": NaN}', errors.INVALID_JSON, "NaN"),
    (b"[1, 2]", errors.INVALID_REQUEST, "object"),
    (b'"just a string"', errors.INVALID_REQUEST, "object"),
    ({"method": "POST", "url": CHAT, "body": {}}, errors.INVALID_CUSTOM_ID, "missing"),
    ({**line(), "custom_id": 5}, errors.INVALID_CUSTOM_ID, "string"),
    ({**line(), "custom_id": "  "}, errors.INVALID_CUSTOM_ID, "empty"),
    ({**line(), "custom_id": "x" * 600}, errors.INVALID_CUSTOM_ID, "longer"),
    (line(method="GET"), errors.INVALID_METHOD, "POST"),
    (line(url="/v1/embeddings"), errors.INVALID_URL, "/v1/embeddings"),
    ({**line(), "body": [1]}, errors.INVALID_REQUEST, "body"),
    ({**line(), "body": {"messages": [{"role": "user", "content": "hi"}]}}, errors.MISSING_MODEL, "model"),
    (line(model="gpt-5"), errors.MODEL_NOT_FOUND, "gpt-5"),
    (line(model=7), errors.MODEL_NOT_FOUND, "7"),
    (line(messages=[]), errors.INVALID_MESSAGES, "non-empty"),
    (line(messages="hi"), errors.INVALID_MESSAGES, "non-empty"),
    (line(messages=[{"role": "wizard", "content": "hi"}]), errors.INVALID_MESSAGES, "role"),
    (line(messages=[{"role": "user"}]), errors.INVALID_MESSAGES, "content"),
    (line(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "invalid_image_url", "needs its image"),
    (
        line(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}
            ]
        ),
        "model_not_multimodal",
        "takes no images",
    ),  # a text model: image parts are refused per line
    (line(url=COMPLETIONS, prompt=""), errors.INVALID_PROMPT, "empty"),
    (line(url=COMPLETIONS, prompt=[]), errors.INVALID_PROMPT, "empty"),
    (line(url=COMPLETIONS, prompt=["a", "b"]), errors.INVALID_PROMPT, "2 prompts"),
    (line(url=COMPLETIONS, prompt=[1, 99999]), errors.INVALID_PROMPT, "99999"),
    (line(url=COMPLETIONS, prompt=[1, True]), errors.INVALID_PROMPT, "token ids"),
    (line(url=COMPLETIONS, prompt={"a": 1}), errors.INVALID_PROMPT, "string"),
    (line(max_tokens="10"), errors.INVALID_PARAMETER, "max_tokens must be an integer"),
    (line(max_tokens=True), errors.INVALID_PARAMETER, "max_tokens must be an integer"),
    (line(max_tokens=2.5), errors.INVALID_PARAMETER, "max_tokens must be an integer"),
    (line(max_tokens=0), errors.INVALID_PARAMETER, "max_tokens"),
    (line(max_tokens=-3), errors.INVALID_PARAMETER, "max_tokens"),
    (line(max_tokens=10**12), errors.CONTEXT_LENGTH_EXCEEDED, str(10**12)),
    (line(max_tokens=5, max_completion_tokens=6), errors.INVALID_PARAMETER, "disagree"),
    (line(temperature=-1), errors.INVALID_PARAMETER, "temperature"),
    (line(temperature="hot"), errors.INVALID_PARAMETER, "temperature must be a number"),
    (line(top_p=1.5), errors.INVALID_PARAMETER, "top_p"),
    (line(n=0), errors.INVALID_PARAMETER, "n must be in"),
    (line(n=10_000), errors.INVALID_PARAMETER, "n must be in"),
    (line(stop=[""]), errors.INVALID_PARAMETER, "stop"),
    (line(stop=5), errors.INVALID_PARAMETER, "stop"),
    (line(seed=2**70), errors.INVALID_PARAMETER, "seed"),
    (line(presence_penalty=3), errors.INVALID_PARAMETER, "presence_penalty"),
    (line(min_tokens=50, max_tokens=10), errors.INVALID_PARAMETER, "min_tokens"),
    (line(ignore_eos="yes"), errors.INVALID_PARAMETER, "true or false"),
    (line(stop_token_ids=["a"]), errors.INVALID_PARAMETER, "stop_token_ids"),
    (line(logprobs=3), errors.INVALID_PARAMETER, "logprobs must be true or false"),
    (line(top_logprobs=3), errors.INVALID_PARAMETER, "requires logprobs"),
    (line(logprobs=True, top_logprobs=50), errors.INVALID_PARAMETER, "top_logprobs"),
    (line(url=COMPLETIONS, logprobs=True), errors.INVALID_PARAMETER, "logprobs must be an integer"),
    (line(url=COMPLETIONS, top_logprobs=2), errors.UNSUPPORTED_PARAMETER, "top_logprobs"),
    (line(url=COMPLETIONS, messages=[]), errors.UNSUPPORTED_PARAMETER, "messages"),
    (line(stream=True), errors.UNSUPPORTED_PARAMETER, "stream=true"),
    (line(tools=[{"type": "function"}]), errors.INVALID_PARAMETER, "tools[0] must be"),
    (line(response_format={"type": "xml"}), errors.INVALID_PARAMETER, "response_format.type"),
    (line(url=COMPLETIONS, prompt="x", tools=[{"type": "function"}]), errors.UNSUPPORTED_PARAMETER, "tools"),
    (line(max_token=5), errors.UNSUPPORTED_PARAMETER, "unknown parameter 'max_token'"),
    (line(chat_template_kwargs=[1]), errors.INVALID_PARAMETER, "chat_template_kwargs"),
]


@pytest.mark.parametrize("item,code,words", BAD_LINES, ids=[f"{c}-{i}" for i, (_, c, _) in enumerate(BAD_LINES)])
def test_bad_line(limits, item, code, words):
    # a good line first, so the error's line number is 2 and custom ids known only when parsed
    results = parse(limits, line("ok"), item)
    assert isinstance(results[0], ParsedRequest)
    err = results[1]
    assert isinstance(err, LineError), err
    assert (err.line, err.code) == (2, code), err
    assert words in err.message
    if isinstance(item, dict) and isinstance(item.get("custom_id"), str) and code != errors.INVALID_CUSTOM_ID:
        assert err.custom_id == item["custom_id"]


def test_duplicate_custom_id_second_occurrence_is_the_error(limits):
    results = parse(limits, line("a"), line("b", method="GET"), line("a"), line("b"))
    assert isinstance(results[0], ParsedRequest)
    assert [(r.line, r.code) for r in results[1:]] == [
        (2, errors.INVALID_METHOD),
        (3, errors.DUPLICATE_CUSTOM_ID),
        (4, errors.DUPLICATE_CUSTOM_ID),
    ]
    # the repeat names the custom_id in its message but carries none: "a" and "b" each have one result line
    assert results[2].custom_id is None and "'a'" in results[2].message
    assert results[3].custom_id is None and results[1].custom_id == "b"


def test_context_length_errors_say_the_numbers(limits):
    long_text = "Hello, world! " * 600
    err = error(limits, line(messages=[{"role": "user", "content": long_text}]))
    assert err.code == errors.CONTEXT_LENGTH_EXCEEDED and f"{limits.max_model_len} tokens" in err.message
    err = error(limits, line(url=COMPLETIONS, prompt=[i % 500 for i in range(1000)], max_tokens=100))
    assert err.code == errors.CONTEXT_LENGTH_EXCEEDED
    assert "1000 tokens" in err.message and "(100)" in err.message and "1100" in err.message
    ok = one(limits, line(url=COMPLETIONS, prompt=[i % 500 for i in range(1000)], max_tokens=24))
    assert ok.sampling_params.max_tokens == 24
    err = error(limits, line(url=COMPLETIONS, prompt=[i % 500 for i in range(1020)]))  # 1020 + the default 16
    assert err.code == errors.CONTEXT_LENGTH_EXCEEDED and "the default" in err.message


def test_line_too_long_is_an_error_and_parsing_goes_on(limits):
    big = line("big", messages=[{"role": "user", "content": "x" * 5000}])
    results = parse(limits, line("a"), big, line("c"), max_line_bytes=1000)
    assert [type(r).__name__ for r in results] == ["ParsedRequest", "LineError", "ParsedRequest"]
    assert results[1].code == errors.LINE_TOO_LONG and results[1].line == 2 and "1,000 bytes" in results[1].message
    assert results[2].line == 3


def test_input_limits_raise_input_too_large(limits):
    data = jsonl(*(line(f"r{i}") for i in range(10)))
    with pytest.raises(InputTooLarge) as e:
        list(parse_requests(io.BytesIO(data), {"tiny": limits}, max_lines=5))
    assert e.value.what == "lines" and e.value.limit == 5
    with pytest.raises(InputTooLarge) as e:
        list(parse_requests(io.BytesIO(data), {"tiny": limits}, max_bytes=100))
    assert e.value.what == "bytes"
    assert len(list(parse_requests(io.BytesIO(data), {"tiny": limits}, max_lines=10))) == 10
    assert count_lines(io.BytesIO(data)) == LineCount(10, len(data))
    with pytest.raises(InputTooLarge):
        count_lines(io.BytesIO(data), max_lines=9)
    with pytest.raises(InputTooLarge):
        count_lines(io.BytesIO(data), max_bytes=len(data) - 1)


@given(st.lists(st.sampled_from([b"", b" ", b"x", b"\r", b"\n", b"\n\n", b"ab\n", b"\xef\xbb\xbf"]), max_size=30))
def test_count_lines_counts_non_blank_lines(pieces):
    data = b"".join(pieces)
    expected = sum(1 for piece in data.removeprefix(b"\xef\xbb\xbf").split(b"\n") if piece.strip())
    assert count_lines(io.BytesIO(data)).lines == expected


class _Recording(io.BytesIO):
    def __init__(self, data):
        super().__init__(data)
        self.largest = 0

    def readline(self, size=-1):
        self.largest = max(self.largest, size)
        return super().readline(size)

    def read(self, size=-1):
        raise AssertionError("the whole stream must never be read at once")


def test_streams_line_by_line(limits):
    data = jsonl(*(line(f"r{i}") for i in range(2000)))
    stream = _Recording(data)
    results = parse_requests(stream, {"tiny": limits}, max_line_bytes=4096)
    first = next(results)
    assert first.line == 1 and stream.tell() < len(data) / 2  # results come before the end is read
    assert 0 < stream.largest <= 4096 + 2
    assert sum(1 for _ in results) == 1999


def test_render_chat_matches_apply_chat_template(limits):
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"},
        ],
    ]
    expected = [
        limits.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations
    ]
    assert limits.render_chat(conversations) == expected


def test_engine_chat_and_parser_render_alike(limits):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    assert one(limits, line(messages=messages)).prompt_token_ids == encode_chat(limits.tokenizer, messages)


def test_template_kwargs_may_not_set_apply_chat_template_arguments(limits):
    err = error(limits, line(chat_template_kwargs={"tokenize": True}))
    assert err.code == errors.CHAT_TEMPLATE_ERROR and "tokenize" in err.message
    ok, bad = parse(limits, line("a"), line("b", chat_template_kwargs={"chat_template": "{{ 1 }}"}))
    assert isinstance(ok, ParsedRequest) and bad.code == errors.CHAT_TEMPLATE_ERROR


def test_context_length_from_config():
    assert context_length({"max_position_embeddings": 4096}) == 4096
    assert context_length({"max_position_embeddings": 4096, "sliding_window": 1024}) == 4096  # windows slide
    cfg = {"max_position_embeddings": 4096, "sliding_window": 1024, "use_sliding_window": False}
    assert context_length(cfg) == 4096
    assert context_length({"max_position_embeddings": 4096, "sliding_window": None}) == 4096
    assert context_length({"text_config": {"max_position_embeddings": 512}}) == 512
    assert context_length({"max_position_embeddings": 4096}, max_model_len=100) == 100
    with pytest.raises(ValueError, match="exceeds the model's context length 4096"):
        context_length({"max_position_embeddings": 4096}, max_model_len=5000)
    with pytest.raises(ValueError):
        context_length({})


def test_engine_and_validator_agree_on_the_context_length(tmp_path):
    windowed = write_tiny_model(tmp_path / "windowed", arch="mistral", sliding_window=256)
    assert ModelConfig.load(windowed).max_model_len == ModelLimits.from_dir(windowed).max_model_len == 1024
    missing = write_tiny_model(tmp_path / "missing", arch="llama")
    config = json.loads((missing / "config.json").read_text())
    del config["max_position_embeddings"]
    (missing / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelConfig.load(missing)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelLimits.from_dir(missing)


def test_configured_models_by_name(limits):
    dirs = {"tiny": str(limits.tokenizer.name_or_path)}
    assert limits_by_name(dirs)["tiny"].max_model_len == limits.max_model_len
    assert limits_of(dirs, "tiny").name == "tiny"
    with pytest.raises(UnknownModel, match="available: tiny"):
        limits_of(dirs, "gpt-5")


def test_model_limits_from_dir(limits, tmp_path):
    assert (limits.name, limits.max_model_len, limits.vocab_size) == ("tiny", 1024, 512)
    path = write_tiny_model(tmp_path / "mistral", arch="mistral", sliding_window=256)
    capped = ModelLimits.from_dir(path)
    assert capped.max_model_len == 1024 and capped.name == "mistral"  # the window does not cap it
    assert ModelLimits.from_dir(path) is capped  # cached
    assert ModelLimits.from_dir(path, max_model_len=128).max_model_len == 128
    with pytest.raises(ValueError):
        ModelLimits.from_dir(path, max_model_len=4096)


# ---- nothing a line holds makes the parser raise ------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_field_names = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "seed",
        "logprobs",
        "top_logprobs",
        "stream",
        "top_k",
        "min_p",
        "min_tokens",
        "repetition_penalty",
        "ignore_eos",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "user",
        "chat_template_kwargs",
        "add_special_tokens",
        "response_format",
        "tools",
        "echo",
        "best_of",
        "logit_bias",
        "structured_outputs",
        "tool_choice",
        "parallel_tool_calls",
    ]
)
_bodies = st.dictionaries(_field_names | st.text(max_size=6), _json, max_size=6)
_lines = st.fixed_dictionaries(
    {},
    optional={
        "custom_id": st.text(max_size=5) | _json,
        "method": st.sampled_from(["POST", "GET"]) | _json,
        "url": st.sampled_from([CHAT, COMPLETIONS]) | _json,
        "body": _bodies | _json,
    },
)


def _check_results(results, expected_lines=None):
    for r in results:
        assert isinstance(r, ParsedRequest | LineError)
        if isinstance(r, LineError):
            assert r.code in errors.REQUEST_ERROR_CODES and r.message and r.line >= 1
        else:
            assert r.prompt_token_ids and r.sampling_params.max_tokens >= 1
    if expected_lines is not None:
        assert len(results) == expected_lines


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400))
def test_arbitrary_bytes_never_raise(limits, data):
    _check_results(list(parse_requests(io.BytesIO(data), {"tiny": limits}, max_line_bytes=200)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_lines | _json, min_size=1, max_size=4))
def test_arbitrary_json_never_raises(limits, objs):
    data = b"\n".join(json.dumps(o).encode() for o in objs)
    results = list(parse_requests(io.BytesIO(data), {"tiny": limits}))
    _check_results(results, expected_lines=len(objs))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_bodies, st.sampled_from([CHAT, COMPLETIONS]))
def test_arbitrary_bodies_never_raise(limits, body, url):
    obj = {"custom_id": "x", "method": "POST", "url": url, "body": {"model": "tiny", **body}}
    _check_results(list(parse_requests(io.BytesIO(json.dumps(obj).encode()), limits)), expected_lines=1)


# ---- response shapes -----------------------------------------------------------------------------


def _output(n=1, logprobs=False) -> RequestOutput:
    choices = [
        CompletionOutput(
            index=i,
            text=f"out{i}",
            token_ids=[10 + i, 11 + i],
            finish_reason="stop" if i == 0 else "length",
            logprobs=[
                {10 + i: Logprob(-0.5, 1), 99: Logprob(-1.5, 2), 98: Logprob(float("-inf"), 3)},
                {11 + i: Logprob(-0.25, 1)},
            ]
            if logprobs
            else None,
        )
        for i in reversed(range(n))
    ]
    return RequestOutput(request_id="1", prompt=None, prompt_token_ids=[1, 2, 3], outputs=choices)


def test_chat_completion_body(limits):
    body = chat_completion_body(_output(n=2), model="tiny", created=123, response_id="chatcmpl-x")
    assert body == {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 123,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "out0", "refusal": None},
                "finish_reason": "stop",
                "logprobs": None,
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": "out1", "refusal": None},
                "finish_reason": "length",
                "logprobs": None,
            },
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        "system_fingerprint": body["system_fingerprint"],
    }
    assert body["system_fingerprint"].startswith("fp_")
    lp = chat_completion_body(_output(logprobs=True), model="tiny", logprobs=2, tokenizer=limits)
    content = lp["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and content[0]["logprob"] == -0.5
    assert [t["token"] for t in content] == [limits.tokenizer.decode([t]) for t in (10, 11)]  # their own text
    assert content[0]["bytes"] == list(limits.tokenizer.decode([10]).encode())
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.5, -1.5]
    json.dumps(lp, allow_nan=False)


def test_text_completion_body_and_response_body(limits):
    # without a tokenizer tokens are named by id ("token_id:99"), so none collide as dict keys here
    body = text_completion_body(_output(logprobs=True), model="tiny", logprobs=3)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert (choice["index"], choice["text"], choice["finish_reason"]) == (0, "out0", "stop")
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == [-0.5, -0.25] and lp["text_offset"][0] == 0
    assert list(lp["top_logprobs"][0].values()) == [-0.5, -1.5, -9999.0]  # -inf is not JSON
    json.dumps(body, allow_nan=False)
    req = one(limits, line(url=COMPLETIONS))
    assert response_body(req, _output())["object"] == "text_completion"
    assert response_body(one(limits, line()), _output())["object"] == "chat.completion"


def test_batch_lines():
    ok = batch_output_line("c1", {"x": 1}, line_id="batch_req_1", request_id="req_1")
    assert ok == {
        "id": "batch_req_1",
        "custom_id": "c1",
        "response": {"status_code": 200, "request_id": "req_1", "body": {"x": 1}},
        "error": None,
    }
    bad = batch_error_line("c2", "invalid_json", "nope")
    assert bad["error"] is None and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"] == {
        "message": "nope",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_json",
    }
    cancelled = batch_error_line("c3", "batch_cancelled", "cancelled", status_code=None)
    assert cancelled["response"] is None and cancelled["error"] == {
        "code": "batch_cancelled",
        "message": "cancelled",
    }
    assert cancelled["id"].startswith("batch_req_")
