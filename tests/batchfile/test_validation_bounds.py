"""Validation bounded by configuration, not by input: over-long prompts rejected before being
tokenized whole."""

from __future__ import annotations

import dataclasses
import io
import json
import multiprocessing
import resource
import threading
import time

import pytest

from batchfile.errors import CONTEXT_LENGTH_EXCEEDED, LineError
from batchfile.model_limits import ModelLimits
from batchfile.parser import parse_requests
from batchfile.prompts import SCREEN_CHARS
from batchfile.request import COMPLETIONS_URL
from batchfile.sampling import RequestBounds
from engine.testing.tiny import write_tiny_model
from tests.rss import PeakRSS


@pytest.fixture(scope="module")
def limits(tmp_path_factory) -> ModelLimits:
    path = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", arch="qwen3")
    return ModelLimits.from_dir(path, name="tiny")


def completion(custom_id: str, prompt: str, **body) -> bytes:
    line = {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS_URL, "body": {"prompt": prompt, **body}}
    return json.dumps(line).encode() + b"\n"


def parse(limits: ModelLimits, data: bytes) -> list:
    return list(parse_requests(io.BytesIO(data), {limits.name: limits}))


def test_an_8mb_prompt_is_rejected_fast_without_tokenizing_it(limits):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    (result,) = parse(limits, completion("big", "x " * 4_000_000, model="tiny"))
    elapsed = time.monotonic() - start
    assert isinstance(result, LineError) and result.code == CONTEXT_LENGTH_EXCEEDED
    assert "at least" in result.message
    assert elapsed < 5, elapsed  # tokenizing it whole took 20 s and 2.6 GB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 300 * 1024  # KiB on Linux


def _validate_four_8mb_lines_at_once(limits: ModelLimits, results) -> None:
    """In a fresh process, as an API process is: four 8 MB lines validated by four threads at once."""
    lines = [completion(f"big{i}", "x " * 4_000_000, model="tiny") for i in range(4)]
    found, start = [], threading.Barrier(4)

    def validate(line: bytes) -> None:
        start.wait()
        found.extend(parse(limits, line))

    with PeakRSS() as rss:
        threads = [threading.Thread(target=validate, args=(line,)) for line in lines]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    results.put(([getattr(r, "code", None) for r in found], rss.growth, rss.peak))


def test_four_8mb_lines_validated_at_once_keep_rss_far_under_1gb(limits):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_validate_four_8mb_lines_at_once, args=(limits, results))
    child.start()
    codes, growth, peak = results.get(timeout=120)
    child.join(30)
    assert codes == [CONTEXT_LENGTH_EXCEEDED] * 4
    # real memory (VmHWM of the process): tokenizing one whole took 2.6 GB; measured: 388 MB peak, +97 MB for four
    assert peak < 1 << 30 and growth < 400 << 20, (peak >> 20, growth >> 20)


@pytest.mark.parametrize("word", ["x ", "hello world. ", "no-spaces-at-all-"])
def test_screening_never_rejects_a_prompt_that_fits(limits, word):
    text = word * (3 * SCREEN_CHARS // len(word))
    exact = len(limits.encode([text], add_special_tokens=True)[0])
    fits = dataclasses.replace(limits, max_model_len=exact + 1)
    (ok,) = parse(fits, completion("fits", text, model="tiny", max_tokens=1))
    assert not isinstance(ok, LineError), ok
    assert len(ok.prompt_token_ids) == exact
    too_small = dataclasses.replace(limits, max_model_len=exact // 2)
    (bad,) = parse(too_small, completion("over", text, model="tiny", max_tokens=1))
    assert isinstance(bad, LineError) and bad.code == CONTEXT_LENGTH_EXCEEDED


def _one(limits, data: bytes, **kwargs):
    (result,) = list(parse_requests(io.BytesIO(data), {limits.name: limits}, **kwargs))
    return result


def test_the_output_budget_bounds_n_max_tokens_and_logprobs(limits):
    # the 156-byte line that produced 128,000 tokens with 20 logprobs each (58 MB of output)
    attack = completion("a", "x", model="tiny", max_tokens=1000, n=128, logprobs=5, ignore_eos=True)
    bad = _one(limits, attack)
    assert isinstance(bad, LineError) and bad.code == "output_budget_exceeded"
    assert "n (128) x max_tokens (1000)" in bad.message
    ok = _one(limits, completion("b", "x", model="tiny", max_tokens=1000, n=128))  # 128,000 without logprobs
    assert not isinstance(ok, LineError), ok
    small = RequestBounds(max_output_tokens=1000)
    assert _one(limits, completion("c", "x", model="tiny", max_tokens=500, n=2), bounds=small).sampling_params.n == 2
    over = _one(limits, completion("d", "x", model="tiny", max_tokens=501, n=2), bounds=small)
    assert isinstance(over, LineError) and over.code == "output_budget_exceeded"
    # chat without max_tokens gets the rest of the context, and the budget applies to that
    chat = {
        "custom_id": "e",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2},
    }
    over = _one(limits, json.dumps(chat).encode(), bounds=small)
    assert isinstance(over, LineError) and over.code == "output_budget_exceeded"


def test_stop_strings_are_bounded_in_number_and_length(limits):
    many = _one(limits, completion("a", "x", model="tiny", stop=[str(i) for i in range(300_000)]))
    assert isinstance(many, LineError) and many.code == "invalid_parameter" and "at most 4" in many.message
    assert not isinstance(_one(limits, completion("b", "x", model="tiny", stop=["a", "b", "c", "d"])), LineError)
    five = _one(limits, completion("c", "x", model="tiny", stop=list("abcde")))
    assert isinstance(five, LineError) and "at most 4" in five.message
    native = RequestBounds(max_stop_strings=16)
    five_native = _one(limits, completion("d", "x", model="tiny", stop=list("abcde")), bounds=native)
    assert not isinstance(five_native, LineError), five_native
    long = _one(limits, completion("e", "x", model="tiny", stop=["y" * 1001]))
    assert isinstance(long, LineError) and "at most 1000" in long.message


@pytest.mark.parametrize(
    ("field", "value", "ok"),
    [
        ("temperature", 2, True),
        ("temperature", 2.5, False),
        ("temperature", 3, False),
        ("temperature", -0.1, False),
        ("top_p", 0, True),
        ("top_p", 1, True),
        ("top_p", 1.01, False),
        ("logprobs", 5, True),
        ("logprobs", 6, False),
    ],
)
def test_ranges_follow_openais_spec(limits, field, value, ok):
    result = _one(limits, completion("a", "x", model="tiny", **{field: value}))
    assert isinstance(result, LineError) != ok, result
    if not ok:
        assert result.code == "invalid_parameter" and field in result.message


def test_top_p_zero_keeps_only_the_most_likely_token(limits):
    result = _one(limits, completion("a", "x", model="tiny", top_p=0, temperature=1))
    assert 0 < result.sampling_params.top_p <= 1e-6


def test_openai_face_keeps_four_stop_strings_whatever_the_native_setting():
    from store.settings import Settings

    settings = Settings(max_stop_strings=32)
    assert settings.request_bounds(openai=True).max_stop_strings == 4
    assert settings.request_bounds(openai=False).max_stop_strings == 32
