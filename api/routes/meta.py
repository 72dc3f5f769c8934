"""The OpenAPI document, health and model listing."""

from __future__ import annotations

from flask import Blueprint, jsonify
from sqlalchemy import text

from api.objects import Model, ModelList
from api.openapi import openapi_document
from api.platform import settings
from api.routes.responses import send_object
from api.serializers import ts
from store import models_registry
from store.db import get_engine

bp = Blueprint("meta", __name__)


@bp.get("/openapi.json")
def openapi():
    return jsonify(openapi_document(tuple(sorted(models_registry.model_paths(settings())))))


@bp.get("/healthz")
def healthz():
    with get_engine(settings().database_url).connect() as conn:
        conn.execute(text("select 1"))
    return jsonify({"status": "ok"})


@bp.get("/v1/models")
def models():
    """The models running workers serve now (fresh heartbeats in the registry)."""
    running = models_registry.running_models(settings())
    return send_object(ModelList(data=[Model(id=name, created=ts(w.started_at)) for name, w in running.items()]))
