"""The batch face of structured outputs and function calling: request lines with response_format,
structured_outputs and tools are validated, carried through the shard line, run on a tiny
random-weight model, and answered with bodies the official client's types accept."""

from __future__ import annotations

import io
import json
import re

import jsonschema
import pytest
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion

from batchfile import errors
from batchfile.endpoints.responses import response_body
from batchfile.endpoints.tool_calls import parse_output
from batchfile.errors import LineError
from batchfile.model_limits import ModelLimits
from batchfile.parser import parse_requests
from batchfile.request import CHAT_URL, COMPLETIONS_URL
from batchfile.shard_input import decode_request, encode_request
from engine import LLM
from engine.testing.tiny import write_tiny_model

# A Qwen-style template: tools listed in the system turn, calls as <tool_call> JSON blocks.
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer a call as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1, "maxLength": 10},
                "limit": {"type": "integer", "minimum": 1, "maximum": 20},
            },
            "required": ["query", "limit"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tools") / "model", arch="qwen3", seed=5)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_file.write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


@pytest.fixture(scope="module")
def limits(model_dir) -> ModelLimits:
    return ModelLimits.from_dir(model_dir, name="tiny")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, seed=0)


def line(custom_id="r1", url=CHAT_URL, **body) -> dict:
    if url == CHAT_URL:
        body.setdefault("messages", USER)
    else:
        body.setdefault("prompt", "The quick brown fox")
    body.setdefault("model", "tiny")
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def parse(limits, *items) -> list:
    data = b"".join(json.dumps(i).encode() + b"\n" for i in items)
    return list(parse_requests(io.BytesIO(data), {"tiny": limits}))


def through_shard_line(request):
    return decode_request(encode_request(request))


def run(llm, requests) -> list[dict]:
    """The shard-line requests on the engine, answered as the worker answers them."""
    outputs = llm.generate(
        [{"prompt_token_ids": r.prompt_token_ids} for r in requests],
        [r.sampling_params for r in requests],
        use_tqdm=False,
    )
    return [response_body(r, o, tokenizer=llm.get_tokenizer()) for r, o in zip(requests, outputs)]


# ---- structured outputs --------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}


def test_constrained_lines_run_and_validate_on_both_endpoints(limits, llm):
    items = [
        line(
            "js",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
            },
            temperature=1.0,
            seed=1,
            max_tokens=200,
        ),
        line(
            "jo",
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=2,
            max_tokens=300,
            structured_outputs=None,
        ),
        line("choice", structured_outputs={"choice": ["red", "green", "blue"]}, temperature=1.0, seed=3),
        line("regex-c", url=COMPLETIONS_URL, structured_outputs={"regex": r"[0-9]{2}-[a-z]{3}"}, seed=4),
        line("json-c", url=COMPLETIONS_URL, structured_outputs={"json": json.dumps(SCHEMA)}, max_tokens=200),
        line(
            "grammar-c",
            url=COMPLETIONS_URL,
            structured_outputs={"grammar": 'root ::= "a" [b-d]+ "e"'},
            max_tokens=30,
            seed=5,
        ),
    ]
    requests = [through_shard_line(r) for r in parse(limits, *items)]
    bodies = {r.custom_id: b for r, b in zip(requests, run(llm, requests))}
    text = {
        cid: (b["choices"][0]["message"]["content"] if "message" in b["choices"][0] else b["choices"][0]["text"])
        for cid, b in bodies.items()
    }
    jsonschema.validate(json.loads(text["js"]), SCHEMA)
    jsonschema.validate(json.loads(text["json-c"]), SCHEMA)
    if bodies["jo"]["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text["jo"]), dict)
    assert text["choice"] in ("red", "green", "blue")
    assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", text["regex-c"])
    grammar_done = bodies["grammar-c"]["choices"][0]["finish_reason"] == "stop"  # sampled: "e" may not come in 30
    assert re.fullmatch(r"a[b-d]+e" if grammar_done else r"a[b-d]*", text["grammar-c"]), text["grammar-c"]
    for body in bodies.values():
        (Completion if body["object"] == "text_completion" else ChatCompletion).model_validate(body)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "type 'objekt'",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}}, "name"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "minItems": 4, "maxItems": 2}},
                }
            },
            "minItems (4) exceeds maxItems",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(oops"}}, "not a valid regular expression"),
        ({"structured_outputs": {"choice": "yes"}}, "choice must be a non-empty list"),
        ({"structured_outputs": {"json": "{bad"}}, "not valid JSON"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one kind"),
        ({"structured_outputs": {"colour": "red"}}, "unknown fields"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "give one"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "already constrains",
        ),
    ],
)
def test_bad_constraints_are_per_line_errors(limits, body, message):
    good, bad = parse(limits, line("ok"), line("bad", **body))
    assert not isinstance(good, LineError)
    assert isinstance(bad, LineError) and bad.code == errors.INVALID_PARAMETER, bad
    assert message in bad.message


def test_n_greedy_copies(limits, llm):
    (request,) = [through_shard_line(r) for r in parse(limits, line(n=3, temperature=0, max_tokens=5, ignore_eos=True))]
    assert request.sampling_params.n == 1 and request.options == {"copies": 3}
    (body,) = run(llm, [request])
    ChatCompletion.model_validate(body)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in body["choices"]}) == 1
    assert body["usage"]["completion_tokens"] == 3 * 5


# ---- tools ---------------------------------------------------------------------------------------


def test_tools_are_rendered_through_the_chat_template(limits):
    (request,) = parse(limits, line(tools=TOOLS))
    prompt = limits.tokenizer.decode(request.prompt_token_ids)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and '"name": "search"' in prompt
    assert request.sampling_params.structured_outputs is None  # auto: the model decides
    assert request.options["tools"]["mode"] == "auto"


def _check_calls(body, names=None):
    ChatCompletion.model_validate(body)
    for choice in body["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert calls and choice["message"]["content"] is None
        for call in calls:
            assert call["id"].startswith("call_") and call["type"] == "function"
            name = call["function"]["name"]
            assert names is None or name in names
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[name])


def test_required_and_named_calls_always_validate(limits, llm):
    items = []
    for seed in range(6):
        items.append(
            line(
                f"req{seed}",
                tools=TOOLS,
                tool_choice="required",
                temperature=1.0,
                seed=seed,
                max_tokens=250,
                parallel_tool_calls=seed % 2 == 0,
            )
        )
        name = TOOLS[seed % 2]["function"]["name"]
        items.append(
            line(
                f"named{seed}",
                tools=TOOLS,
                temperature=1.0,
                seed=seed,
                max_tokens=200,
                n=2,
                tool_choice={"type": "function", "function": {"name": name}},
            )
        )
    requests = [through_shard_line(r) for r in parse(limits, *items)]
    for request, body in zip(requests, run(llm, requests)):
        if request.custom_id.startswith("named"):
            _check_calls(body, {request.options["tools"]["name"]})
        else:
            _check_calls(body)
            if request.custom_id in ("req1", "req3", "req5"):  # parallel_tool_calls false: one call
                assert all(len(c["message"]["tool_calls"]) == 1 for c in body["choices"])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "function.name"),
        ({"tools": [WEATHER, WEATHER]}, "declared twice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tools_are_per_line_errors(limits, body, message):
    (bad,) = parse(limits, line(**body))
    assert isinstance(bad, LineError) and message in bad.message, bad


def test_auto_round_trips_a_call_in_the_templates_format(limits):
    """A call the model writes in its template's format becomes message.tool_calls; sent back as an
    assistant message (with the tool's answer), the template renders the same call again."""
    emitted = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    content, calls = parse_output(emitted, {"mode": "auto"})
    assert content is None and len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 degrees"},
    ]
    (request,) = parse(limits, line(tools=TOOLS, messages=history))
    assert not isinstance(request, LineError), request
    prompt = limits.tokenizer.decode(request.prompt_token_ids)
    assert emitted in prompt and "<tool_response>\n18 degrees" in prompt


@pytest.mark.parametrize(
    ("text", "names", "content"),
    [
        (
            'Let me look.<tool_call>{"name": "search", "arguments": {"query": "x", "limit": 2}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
            ["search", "get_weather"],
            "Let me look.",
        ),
        ('{"name": "get_weather", "parameters": {"city": "Rome"}}', ["get_weather"], None),  # Llama 3.x
        (
            '<|python_tag|>{"name": "search", "parameters": {"query": "q", "limit": 1}}; '
            '{"name": "get_weather", "parameters": {"city": "Rome"}}',
            ["search", "get_weather"],
            None,
        ),
        ("Just text, no call.", [], "Just text, no call."),
        ('<tool_call>{"name": broken</tool_call>', [], '<tool_call>{"name": broken</tool_call>'),
    ],
)
def test_auto_parses_hermes_and_llama_formats(text, names, content):
    got_content, calls = parse_output(text, {"mode": "auto"})
    assert got_content == content
    assert [c["function"]["name"] for c in calls] == names
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])


# ---- /v1/responses -------------------------------------------------------------------------------


def test_responses_lines_answer_with_response_objects(limits, llm):
    from openai.types.responses import Response

    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    items = [
        {
            "custom_id": "text",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": "tiny",
                "input": "Hello!",
                "instructions": "Be brief.",
                "max_output_tokens": 6,
                "temperature": 0,
            },
        },
        {
            "custom_id": "schema",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": "tiny",
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                "text": {"format": fmt},
                "max_output_tokens": 200,
                "temperature": 1.0,
            },
        },
        {
            "custom_id": "tool",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": "tiny",
                "input": [
                    {"role": "user", "content": "Weather?"},
                    {
                        "type": "function_call",
                        "call_id": "call_1",
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo"}',
                    },
                    {"type": "function_call_output", "call_id": "call_1", "output": "5 degrees"},
                    {"role": "user", "content": "And in Rome?"},
                ],
                "tools": [{"type": "function", **WEATHER["function"]}],
                "max_output_tokens": 120,
                "tool_choice": {"type": "function", "name": "get_weather"},
            },
        },
    ]
    requests = [through_shard_line(r) for r in parse(limits, *items)]
    assert all(not isinstance(r, LineError) for r in requests), requests
    prompt = limits.tokenizer.decode(requests[0].prompt_token_ids)
    assert "system\nBe brief." in prompt and "user\nHello!" in prompt
    assert "<tool_response>\n5 degrees" in limits.tokenizer.decode(requests[2].prompt_token_ids)
    bodies = {r.custom_id: Response.model_validate(b) for r, b in zip(requests, run(llm, requests))}
    assert bodies["text"].status == "incomplete" and bodies["text"].incomplete_details.reason == "max_output_tokens"
    assert bodies["text"].usage.output_tokens == 6 and bodies["text"].instructions == "Be brief."
    jsonschema.validate(json.loads(bodies["schema"].output_text), SCHEMA)
    (call,) = bodies["tool"].output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMS["get_weather"])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": []}, "non-empty array"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "function only"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "frobnicate": 1}, "unknown parameter"),
        ({"input": [{"type": "image", "url": "x"}]}, "not supported"),
    ],
)
def test_bad_responses_lines(limits, body, message):
    (bad,) = parse(
        limits, {"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": {"model": "tiny", **body}}
    )
    assert isinstance(bad, LineError) and message in bad.message, bad


def test_empty_tool_fields_stay_harmless_on_completions(limits):
    (request,) = parse(limits, line(url=COMPLETIONS_URL, tools=[], tool_choice=None, parallel_tool_calls=True))
    assert not isinstance(request, LineError), request
    assert request.options == {} and request.sampling_params.structured_outputs is None
