"""Workers register their model (name, path, endpoints, context length) with heartbeats; /v1/models lists
the models with fresh heartbeats and the API validates lines with the tokenizer at the registered path."""

from __future__ import annotations

import time
from datetime import timedelta

from sqlalchemy import update

from engine.hf.model_info import context_length, read_config
from store import models_registry
from store.db import session_scope
from store.models import WorkerModel, utcnow
from store.models_registry import Registration
from tests.helpers import MODEL, chat_line, jsonl, validated, wait_for, wait_until
from workers.registration import Heartbeat


def _reg(name: str, path: str, worker: str | None = None) -> Registration:
    return Registration(worker or f"{name}-1@host-b", name, path, ("/v1/completions",), 64, "host-b", 1)


def test_live_worker_is_registered_and_listed(worker, client):
    running = models_registry.running_models(worker.settings)
    assert MODEL in running
    entry = running[MODEL]
    assert entry.path == worker.model_path
    assert entry.endpoints == ["/v1/chat/completions", "/v1/completions"]
    assert entry.max_model_len == context_length(read_config(worker.model_path)) > 0
    assert entry.metrics_port == worker.metrics_port
    body = client.get("/v1/models").get_json()
    listed = {m["id"]: m for m in body["data"]}
    assert MODEL in listed and listed[MODEL]["created"] == int(entry.started_at.timestamp())


def test_api_without_models_env_validates_with_the_registered_tokenizer(worker):
    client = worker.app(models={}).test_client()  # no PAGEDBATCH_MODELS on this API
    body = jsonl([chat_line("r-0", "hello"), chat_line("r-1", "x" * 50, max_tokens=10_000_000)])
    job = client.post(f"/v1/jobs?model={MODEL}", data=body, content_type="application/x-ndjson")
    assert job.status_code == 201, job.get_json()
    job = validated(client, job)
    assert job["request_counts"]["invalid"] == 1  # max_tokens over the registered model's context length
    assert job["errors"][0]["line"] == 2, job["errors"]
    done = wait_for(lambda: client.get(f"/v1/jobs/{job['id']}").get_json(), timeout=120)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 1
    unknown = client.post("/v1/jobs?model=nope", data=body, content_type="application/x-ndjson")
    assert unknown.status_code == 400 and "unknown model 'nope'" in unknown.get_json()["error"]["message"]


def test_stale_heartbeats_drop_out_and_renew(platform, client):
    settings = platform.settings
    models_registry.register(settings, _reg("ghost", platform.model_path))
    try:
        assert "ghost" in models_registry.running_models(settings)
        assert "ghost" in {m["id"] for m in client.get("/v1/models").get_json()["data"]}
        with session_scope(settings.database_url) as s:  # the worker stopped beating a while ago
            s.execute(
                update(WorkerModel)
                .where(WorkerModel.worker == "ghost-1@host-b")
                .values(heartbeat_at=utcnow() - models_registry.fresh_after() - timedelta(seconds=1))
            )
        assert "ghost" not in models_registry.running_models(settings)
        assert "ghost" not in {m["id"] for m in client.get("/v1/models").get_json()["data"]}
        assert models_registry.heartbeat(settings, "ghost-1@host-b")  # it beats again: listed again
        assert "ghost" in models_registry.running_models(settings)
    finally:
        models_registry.unregister(settings, "ghost-1@host-b")
    assert "ghost" not in models_registry.running_models(settings)
    assert not models_registry.heartbeat(settings, "ghost-1@host-b")


def test_env_models_override_registered_paths(platform):
    settings = platform.settings
    models_registry.register(settings, _reg("shadow", "/nowhere/shadow"))
    try:
        paths = models_registry.model_paths(settings)
        assert paths["shadow"] == "/nowhere/shadow" and paths[MODEL] == platform.model_path
        # a registered path this host cannot read: a clear 400 naming the path and the override
        client = platform.app(models={}).test_client()
        line = jsonl([chat_line("s", "hi")])
        r = client.post("/v1/jobs?model=shadow", data=line, content_type="application/x-ndjson")
        assert r.status_code == 400, r.get_json()
        message = r.get_json()["error"]["message"]
        assert "/nowhere/shadow" in message and "PAGEDBATCH_MODELS" in message
        overridden = platform.app(models={"shadow": platform.model_path}).test_client()
        r = overridden.post(
            "/v1/jobs?model=shadow", data=jsonl([chat_line("s", "hi")]), content_type="application/x-ndjson"
        )
        assert r.status_code == 201, r.get_json()
    finally:
        models_registry.unregister(settings, "shadow-1@host-b")


def test_heartbeat_thread_renews_and_unregisters(platform):
    settings = platform.settings
    beat = Heartbeat(settings, _reg("beating", platform.model_path), interval_s=0.1)
    try:
        first = models_registry.running_models(settings)["beating"].heartbeat_at
        wait_until(
            lambda: models_registry.running_models(settings)["beating"].heartbeat_at != first, 10, what="a heartbeat"
        )
        models_registry.unregister(settings, "beating-1@host-b")  # e.g. an operator cleaned the table
        deadline = time.monotonic() + 10
        while "beating" not in models_registry.running_models(settings):
            assert time.monotonic() < deadline, "not registered again"
            time.sleep(0.05)
    finally:
        beat.close()
    assert "beating" not in models_registry.running_models(settings)


def test_an_embedding_model_registers_the_embeddings_endpoint(tmp_path):
    from engine.testing.tiny import write_tiny_model
    from engine.testing.tiny_embedding import write_tiny_embedding_model
    from workers.registration import registration_for

    write_tiny_embedding_model(tmp_path / "embed")
    write_tiny_model(tmp_path / "chat")
    embed = registration_for("e", str(tmp_path / "embed"), max_model_len=None, metrics_port=None)
    chat = registration_for("c", str(tmp_path / "chat"), max_model_len=None, metrics_port=None)
    assert embed.endpoints == ("/v1/embeddings", "/v1/score", "/v1/rerank")
    assert chat.endpoints == ("/v1/chat/completions", "/v1/completions")


def test_encoders_register_their_endpoints_and_context(tmp_path):
    from engine.testing.tiny_encoder import write_tiny_classifier, write_tiny_encoder
    from workers.registration import registration_for

    write_tiny_encoder(tmp_path / "emb", "xlm-roberta")
    write_tiny_classifier(tmp_path / "ce", "bert", num_labels=1)
    emb = registration_for("e", str(tmp_path / "emb"), max_model_len=None, metrics_port=None)
    ce = registration_for("c", str(tmp_path / "ce"), max_model_len=None, metrics_port=None)
    assert emb.endpoints == ("/v1/embeddings", "/v1/score", "/v1/rerank")
    assert emb.max_model_len == 256  # XLM-RoBERTa: 256 + pad id + 1 position embeddings
    assert ce.endpoints == ("/v1/score", "/v1/rerank")
