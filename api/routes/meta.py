"""The OpenAPI document, health and model listing."""

from __future__ import annotations

from flask import Blueprint, jsonify
from sqlalchemy import text

from api.objects import Model, ModelList
from api.platform import settings
from api.routes.responses import send_object
from api.serializers import ts
from api.spec.openapi import openapi_document
from store import models_registry
from store.db import get_engine
from store.filestore.storage_health import check_storage

bp = Blueprint("meta", __name__)


@bp.get("/openapi.json")
def openapi():
    cfg = settings()
    return jsonify(openapi_document(tuple(sorted(models_registry.model_paths(cfg))), cfg.max_upload_bytes))


@bp.get("/healthz")
def healthz():
    with get_engine(settings().database_url).connect() as conn:
        conn.execute(text("select 1"))
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz():
    """Readiness: the database answers (else 503), and the storage takes writes and, locally, has more free
    space than PAGEDBATCH_STORAGE_MIN_FREE_BYTES. A degraded storage still answers 200 (reads and job status
    keep working) with `"status": "degraded"` and the reasons."""
    cfg = settings()
    try:
        with get_engine(cfg.database_url).connect() as conn:
            conn.execute(text("select 1"))
    except Exception:  # reported
        return jsonify({"status": "unavailable", "database": "unreachable"}), 503
    storage = check_storage(cfg)
    return jsonify({"status": storage["status"], "database": "ok", "storage": storage})


@bp.get("/v1/models")
def models():
    """The models running workers serve now (fresh heartbeats in the registry), and the LoRA adapters served
    over them (`parent`: the base model), as vLLM lists them."""
    running = models_registry.running_models(settings())
    data = [Model(id=name, created=ts(w.started_at), root=w.path) for name, w in running.items()]
    data += [
        Model(id=name, created=ts(w.started_at), root=path, parent=w.model)
        for w in running.values()
        for name, path in sorted(w.adapters.items())
        if name not in running
    ]
    return send_object(ModelList(data=data))
