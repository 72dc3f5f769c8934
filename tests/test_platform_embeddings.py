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
        from engine.tiny_embedding import write_tiny_embedding_model

        self.model_path = str(write_tiny_embedding_model(self.tmp / "tiny-embed", "qwen3", "last",
                                                         matryoshka_dimensions=[16, 32, 64]))
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

    client = openai.OpenAI(base_url=embedding_platform.start_server() + "/v1", api_key=embedding_platform.api_key,
                           max_retries=0)

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
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h",
                                  extra_body={"on_invalid_lines": "skip"})
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
