"""Bad input through the API, end to end (no worker: jobs stay queued): arbitrary bytes, invalid UTF-8,
huge and deeply nested lines, wrong types everywhere, odd max_tokens, empty files, duplicate ids,
unknown urls and models, prompts over the context. Each is a per-line error of a created job or a 4xx,
never a 5xx, and the server keeps serving. (tests/batchfile/test_requests_parsing.py covers the parser alone.)"""

import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchfile.errors import REQUEST_ERROR_CODES
from batchfile.lines import DEFAULT_MAX_LINE_BYTES
from tests.helpers import MODEL, chat_line, completion_line, jsonl, validated

pytestmark = pytest.mark.slow  # hundreds of generated uploads

CONTEXT = 1024  # the tiny model's max_position_embeddings
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def api(platform):
    return platform.app().test_client()


def post_raw(api, body: bytes, **query):
    return api.post("/v1/jobs", query_string={"model": MODEL, **query}, data=body, content_type="application/x-ndjson")


def post_multipart(api, body: bytes, model=MODEL):
    data = {"file": (io.BytesIO(body), "in.jsonl"), "model": model}
    return api.post("/v1/jobs", data=data, content_type="multipart/form-data")


def create_batch(api, body: bytes, endpoint="/v1/chat/completions"):
    r = api.post(
        "/v1/files",
        data={"file": (io.BytesIO(body), "in.jsonl"), "purpose": "batch"},
        content_type="multipart/form-data",
    )
    assert r.status_code == 200, r.get_json()
    return api.post(
        "/v1/batches",
        json={"input_file_id": r.get_json()["id"], "endpoint": endpoint, "completion_window": "24h"},
    )


def batch_job(api, r) -> dict:
    """A created batch as the native job it is, once validated."""
    return api.get(f"/v1/jobs/{validated(api, r)['id']}").get_json()


def dumps(value) -> str:
    return json.dumps(value, allow_nan=True)


def check_job(api, r, lines: int | None = None) -> dict:
    """A created job whose every bad line is a per-line error with a known code and its line number."""
    assert r.status_code == 201, (r.status_code, r.get_data()[:500])
    job = validated(api, r)
    counts = job["request_counts"]
    assert counts["total"] == counts["valid"] + counts["invalid"]
    if lines is not None:
        assert counts["total"] == lines
    assert job["status"] == ("in_progress" if counts["valid"] else "failed")
    for error in job["errors"]:
        assert error["code"] in REQUEST_ERROR_CODES | {"empty_file"}, error
        assert error["message"]
    errors = [json.loads(x) for x in api.get(f"/v1/jobs/{job['id']}/errors").data.splitlines()]
    assert len(errors) == counts["invalid"]
    assert all(e["response"]["status_code"] == 400 for e in errors)
    return job


def error_codes(job) -> list[str]:
    return [e["code"] for e in sorted(job["errors"], key=lambda e: e["line"] or 0)]


def assert_4xx(r):
    assert 400 <= r.status_code < 500, (r.status_code, r.get_data()[:500])
    assert set(r.get_json()["error"]) == {"message", "type", "param", "code"}


# ---- arbitrary bytes ---------------------------------------------------------------------------


@FUZZ
@given(body=st.binary(max_size=2000) | st.lists(st.binary(max_size=80), max_size=6).map(b"\n".join))
def test_arbitrary_bytes_raw_and_multipart(api, body):
    for r in (post_raw(api, body), post_multipart(api, body)):  # CR-only line endings read as line ends
        check_job(api, r)


@FUZZ
@given(lines=st.lists(st.binary(min_size=1, max_size=40).filter(lambda b: b"\n" not in b), min_size=1, max_size=5))
def test_invalid_utf8_lines(api, lines):
    good = [dumps(chat_line("good", "hi")).encode()]
    body = b"\n".join(good + [b"\xff" + line + b"\xc3" for line in lines]) + b"\n"
    job = check_job(api, post_raw(api, body), lines=1 + len(lines))
    assert job["request_counts"]["valid"] == 1
    assert set(error_codes(job)) <= {"invalid_utf8", "invalid_json"}


# ---- wrong types everywhere --------------------------------------------------------------------

FIELDS = ["custom_id", "method", "url", "body"]
BODY_FIELDS = ["model", "messages", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "top_k", "logprobs"]


@FUZZ
@given(
    field=st.sampled_from(FIELDS + [f"body.{f}" for f in BODY_FIELDS]),
    value=json_values,
    face=st.sampled_from(["native", "openai"]),
)
def test_wrong_types_are_line_errors(api, field, value, face):
    line = chat_line("x", "hello")
    if field.startswith("body."):
        line["body"][field[5:]] = value
    else:
        line[field] = value
    body = jsonl([chat_line("ok", "fine"), line])
    if face == "native":
        job = check_job(api, post_raw(api, body), lines=2)
    else:
        r = create_batch(api, body)
        assert r.status_code == 200, r.get_json()
        job = batch_job(api, r)
        assert job["request_counts"]["total"] == 2
    assert job["request_counts"]["valid"] >= 1  # the good line stays good whatever its neighbour holds


@FUZZ
@given(value=json_values, where=st.sampled_from(["line", "defaults"]))
def test_any_json_value_as_a_line_or_defaults(api, value, where):
    if where == "line":
        check_job(api, post_raw(api, (dumps(value) + "\n").encode()), lines=1)
        return
    r = post_raw(api, jsonl([chat_line("a", "x")]), defaults=dumps(value))
    if isinstance(value, dict) and r.status_code == 201:
        check_job(api, r, lines=1)
    else:  # not an object, or an object the store refuses (NUL characters, NaN, too deep): a clear 4xx
        assert_4xx(r)


@FUZZ
@given(
    max_tokens=st.integers(-(2**80), 2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.booleans()
    | st.text(max_size=5)
    | st.sampled_from([0, -1, 1, CONTEXT - 1, CONTEXT, 2**31, 2**63, 10**30]),
    url=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
)
def test_max_tokens_of_every_kind(api, max_tokens, url):
    make = chat_line if url == "/v1/chat/completions" else completion_line
    job = check_job(api, post_raw(api, (dumps(make("m", "hello", max_tokens=max_tokens)) + "\n").encode()), lines=1)
    fits = isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and 1 <= max_tokens < CONTEXT - 1
    if fits:
        assert job["request_counts"]["valid"] == 1, job["errors"]
    elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        # NaN and Infinity are not JSON at all (invalid_json); every other non-integer is a bad parameter
        assert error_codes(job) in (["invalid_parameter"], ["invalid_json"]), job["errors"]
    elif max_tokens >= CONTEXT:
        assert error_codes(job) == ["context_length_exceeded"], job["errors"]


# ---- each named case ---------------------------------------------------------------------------


def test_empty_files(api):
    for r in (post_raw(api, b""), post_multipart(api, b""), post_raw(api, b"\n\n  \n")):
        job = check_job(api, r, lines=0)
        assert job["status"] == "failed" and error_codes(job) == ["empty_file"]
    r = create_batch(api, b"")
    assert r.status_code == 200 and validated(api, r)["status"] == "failed"


def test_a_huge_line_is_a_line_error(api):
    huge = dumps(completion_line("huge", "word " * (DEFAULT_MAX_LINE_BYTES // 5 + 10))).encode()
    assert len(huge) > DEFAULT_MAX_LINE_BYTES
    body = jsonl([completion_line("before", "x")]) + huge + b"\n" + jsonl([completion_line("after", "y")])
    job = check_job(api, post_raw(api, body), lines=3)
    assert job["request_counts"]["valid"] == 2
    assert [(e["line"], e["code"]) for e in job["errors"]] == [(2, "line_too_long")]


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deeply_nested_json(api, depth):
    deep_list = "[" * depth + "]" * depth
    deep_obj = '{"a":' * depth + "1" + "}" * depth
    line = '{"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": ' + deep_obj + "}"
    job = check_job(api, post_raw(api, (deep_list + "\n" + line + "\n").encode()), lines=2)
    assert set(error_codes(job)) <= {"invalid_json", "invalid_request", "unsupported_parameter"}
    assert_4xx(post_raw(api, jsonl([chat_line("a", "x")]), defaults=deep_obj))
    assert_4xx(post_raw(api, jsonl([chat_line("a", "x")]), metadata=deep_obj))
    for not_json in ('{"temperature": Infinity}', '{"temperature": NaN}', '{"temperature": 1e999}'):
        assert_4xx(post_raw(api, jsonl([chat_line("a", "x")]), defaults=not_json))
    batch = '{"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "24h", "metadata": '
    assert_4xx(api.post("/v1/batches", data=batch + deep_obj + "}", content_type="application/json"))
    assert_4xx(api.post("/v1/batches", data=deep_list, content_type="application/json"))


def test_duplicate_ids_unknown_urls_models_and_long_prompts(api):
    lines = [
        completion_line("same", "a"),
        completion_line("same", "b"),
        {**completion_line("u", "x"), "url": "/v1/embeddings"},
        {**chat_line("m", "x"), "body": {**chat_line("m", "x")["body"], "model": "no-such-model"}},
        completion_line("long", "word " * 3000),
        chat_line("long-chat", "word " * 3000),
        completion_line("ok", "fine"),
    ]
    job = check_job(api, post_raw(api, jsonl(lines)), lines=7)
    # the native face runs every line on the job's model: a line naming another model is an error there
    assert error_codes(job) == [
        "duplicate_custom_id",
        "invalid_url",
        "model_mismatch",
        "context_length_exceeded",
        "context_length_exceeded",
    ]
    r = create_batch(api, jsonl(lines), endpoint="/v1/completions")
    assert r.status_code == 200
    batch = batch_job(api, r)
    assert error_codes(batch) == [
        "duplicate_custom_id",
        "invalid_url",
        "model_not_found",
        "context_length_exceeded",
        "context_length_exceeded",  # a chat line in a /v1/completions batch, and too long besides
    ]
    assert_4xx(post_raw(api, jsonl(lines), model="no-such-model"))


@FUZZ
@given(text=st.text(min_size=1, max_size=30))
def test_nul_and_odd_text_in_ids_and_parameters(api, text):
    nul = text + "\x00"
    for path in (f"/v1/jobs/{nul}", f"/v1/files/{nul}", f"/v1/batches/{nul}", f"/v1/jobs/{nul}/errors"):
        assert_4xx(api.get(path))
    assert_4xx(api.get("/v1/jobs", query_string={"after": nul}))
    assert_4xx(api.get("/v1/files", query_string={"purpose": nul}))
    assert_4xx(post_raw(api, jsonl([chat_line("a", "x")]), metadata=json.dumps({"k": nul})))
    assert_4xx(post_raw(api, jsonl([chat_line("a", "x")]), defaults=json.dumps({"user": nul})))
    batch = {"input_file_id": nul, "endpoint": "/v1/completions", "completion_window": "24h"}
    assert_4xx(api.post("/v1/batches", json=batch))
    r = api.post(
        "/v1/files",
        data={"file": (io.BytesIO(jsonl([chat_line("a", nul)])), "in\x00\x07put" * 100), "purpose": "batch"},
        content_type="multipart/form-data",
    )
    assert r.status_code == 200, r.get_json()
    assert r.get_json()["filename"] == ("input" * 100)[:255]  # control characters out, cut to fit
    job = check_job(api, post_raw(api, jsonl([chat_line(nul, nul)])), lines=1)
    assert job["request_counts"]["valid"] == 1  # NUL is a character like another inside a request


def test_doubled_slashes_are_json_404s_not_redirects(api):
    for path in ("/v1/jobs//x", "/v1/files///x", "/v1/batches//x%00", "/v1/jobs//x/errors", "/v1/jobs/%2Fx"):
        r = api.get(path)
        assert r.status_code == 404, (path, r.status_code, r.headers.get("Location"))
        assert set(r.get_json()["error"]) == {"message", "type", "param", "code"}


def test_metadata_must_be_string_pairs(api):
    for metadata in ({"a": {"b": 1}}, {"a": 1}, {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, [1]):
        assert_4xx(post_raw(api, jsonl([chat_line("a", "x")]), metadata=json.dumps(metadata)))
    assert post_raw(api, jsonl([chat_line("a", "x")]), metadata=json.dumps({"team": "a"})).status_code == 201


def test_the_server_keeps_serving(api):
    post_raw(api, b"\xff" * 1000 + b"\n" + b"[" * 50_000)
    assert api.get("/healthz").status_code == 200
    job = check_job(api, post_raw(api, jsonl([chat_line("a", "x"), completion_line("b", "y")])), lines=2)
    assert job["request_counts"]["valid"] == 2
