"""The offline path: an OpenAI batch file through the engine into one Parquet results file."""

from __future__ import annotations

import json
import uuid

import pyarrow.parquet as pq
import pytest

from batchfile.errors import CONTEXT_LENGTH_EXCEEDED, DUPLICATE_CUSTOM_ID, INVALID_JSON
from batchfile.request import CHAT_URL, COMPLETIONS_URL
from engine.params.outputs import CompletionOutput, RequestOutput
from engine.testing.tiny import write_tiny_model
from store.results.jsonl import iter_error_jsonl, iter_output_jsonl
from store.results.parquet import count_results
from store.results.rows import RESULT_SCHEMA
from workers.offline import run_offline

CHAT, COMPLETIONS = CHAT_URL, COMPLETIONS_URL


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("offline") / "tiny-qwen3", arch="qwen3")


def _write_input(path, lines) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def _line(custom_id, url=CHAT, **body):
    if url == CHAT:
        body.setdefault("messages", [{"role": "user", "content": f"Hello, {custom_id}!"}])
    else:
        body.setdefault("prompt", f"The quick brown {custom_id}")
    body.setdefault("model", "gpt-4o-mini")  # any name: the offline model serves every line
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_run_offline_with_the_engine(model_dir, tmp_path):
    from engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), device="cpu", dtype="float32")
    lines = [
        _line("chat", max_tokens=6, temperature=0),
        _line("text", url=COMPLETIONS, max_tokens=5, temperature=0.7, n=2, seed=3),
        "not json at all",
        _line("long", max_tokens=100_000),
        _line("ids", url=COMPLETIONS, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0),
        _line("chat", max_tokens=3),  # duplicate custom_id
    ]
    _write_input(tmp_path / "in.jsonl", lines)
    summary = run_offline(tmp_path / "in.jsonl", tmp_path / "out.parquet", model_dir, progress=False, llm=llm)
    assert (summary.total, summary.completed, summary.failed, summary.cancelled) == (6, 3, 3, 0)

    table = pq.read_table(summary.output_path)
    assert table.schema == RESULT_SCHEMA
    rows = table.to_pylist()
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["status"] for r in rows] == [
        "completed",
        "completed",
        "failed",
        "failed",
        "completed",
        "failed",
    ]
    assert [r["error_code"] for r in rows if r["status"] == "failed"] == [
        INVALID_JSON,
        CONTEXT_LENGTH_EXCEEDED,
        DUPLICATE_CUSTOM_ID,
    ]
    chat, text, _, _, ids, _ = rows
    assert chat["model"] == "tiny-qwen3" and chat["url"] == CHAT
    assert len(chat["output_token_ids"]) == chat["completion_tokens"] <= 6
    assert chat["finish_reason"] in ("stop", "length")
    assert chat["started_at"] <= chat["finished_at"] and chat["latency_ms"] >= 0
    body = json.loads(text["response_body"])
    assert body["object"] == "text_completion" and len(body["choices"]) == 2
    assert text["completion_tokens"] == body["usage"]["completion_tokens"]
    assert text["output_text"] == body["choices"][0]["text"]
    assert summary.prompt_tokens == sum(r["prompt_tokens"] or 0 for r in rows)
    assert summary.completion_tokens == sum(r["completion_tokens"] for r in rows)

    # greedy results match the engine run directly on the same prompt token ids
    tokenizer = llm.get_tokenizer()
    text_ids = tokenizer(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello, chat!"}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    ).input_ids
    assert chat["prompt_tokens"] == len(text_ids)
    direct = llm.generate(
        [{"prompt_token_ids": text_ids}, {"prompt_token_ids": [5, 6, 7, 8]}],
        [SamplingParams(max_tokens=6, temperature=0), SamplingParams(max_tokens=4, temperature=0)],
    )
    assert chat["output_token_ids"] == direct[0].outputs[0].token_ids
    assert ids["output_token_ids"] == direct[1].outputs[0].token_ids
    assert ids["output_text"] == direct[1].outputs[0].text

    out = [json.loads(s) for s in iter_output_jsonl(summary.output_path)]
    err = [json.loads(s) for s in iter_error_jsonl(summary.output_path)]
    assert [o["custom_id"] for o in out] == ["chat", "text", "ids"]
    assert [e["response"]["status_code"] for e in err] == [400, 400, 400]


def test_run_offline_loads_the_engine_and_writes_to_fsspec(model_dir, tmp_path):
    _write_input(tmp_path / "in.jsonl", [_line("a", max_tokens=2), _line("b", url=COMPLETIONS, max_tokens=2)])
    url = f"memory://offline-{uuid.uuid4().hex}/results.parquet"
    summary = run_offline(
        tmp_path / "in.jsonl",
        url,
        model_dir,
        progress=True,
        engine_kwargs={"device": "cpu"},
        defaults={"temperature": 0.0},
        model_name="served",
    )
    assert (summary.completed, summary.failed) == (2, 0)
    counts = count_results(url)
    assert counts.completed == 2 and counts.completion_tokens == summary.completion_tokens
    assert json.loads(next(iter_output_jsonl(url)))["response"]["body"]["model"] == "served"


class _FakeEngine:
    """The engine's step API: finishes each request one step after it was added."""

    max_model_len = 1024

    def __init__(self, reject=()):
        self.waiting: dict[str, tuple] = {}
        self.peak = 0
        self.reject = set(reject)
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params):
        if request_id in self.reject:
            raise ValueError("the KV pool is too small for this request")
        self.waiting[request_id] = (prompt["prompt_token_ids"], params)
        self.peak = max(self.peak, len(self.waiting))

    def step(self):
        if not self.waiting:
            return []
        request_id, (ids, params) = next(iter(self.waiting.items()))
        del self.waiting[request_id]
        choices = [CompletionOutput(i, "ok", [1] * params.max_tokens, "length") for i in range(params.n)]
        return [RequestOutput(request_id, None, ids, choices)]

    def has_unfinished_requests(self):
        return bool(self.waiting)

    def abort_request(self, request_id):
        self.aborted.append(request_id)


class _FakeLLM:
    def __init__(self, engine):
        self.llm_engine = engine


def test_run_offline_bounds_requests_in_flight(model_dir, tmp_path):
    _write_input(tmp_path / "in.jsonl", [_line(f"r{i}", max_tokens=3) for i in range(20)])
    engine = _FakeEngine(reject={"4"})
    summary = run_offline(
        tmp_path / "in.jsonl",
        tmp_path / "out.parquet",
        model_dir,
        progress=False,
        llm=_FakeLLM(engine),
        max_in_flight=3,
    )
    assert engine.peak <= 3
    assert (summary.total, summary.completed, summary.failed) == (20, 19, 1)
    rows = pq.read_table(summary.output_path).to_pylist()
    assert [r["line"] for r in rows] == list(range(1, 21))
    rejected = rows[3]
    assert (rejected["status"], rejected["error_code"]) == ("failed", "engine_rejected")
    assert summary.completion_tokens == 19 * 3


def test_run_offline_aborts_in_flight_requests_on_error(model_dir, tmp_path):
    _write_input(tmp_path / "in.jsonl", [_line(f"r{i}") for i in range(5)])

    class Exploding(_FakeEngine):
        def step(self):
            raise RuntimeError("device lost")

    engine = Exploding()
    with pytest.raises(RuntimeError, match="device lost"):
        run_offline(tmp_path / "in.jsonl", tmp_path / "out.parquet", model_dir, progress=False, llm=_FakeLLM(engine))
    assert sorted(engine.aborted) == ["1", "2", "3", "4", "5"]
    assert not (tmp_path / "out.parquet").exists()
