"""The OpenAPI document, health and model listing."""

from __future__ import annotations

from flask import Blueprint, jsonify
from sqlalchemy import text

from api.objects import Model, ModelList
from api.openapi import openapi_document
from api.platform import settings
from api.routes.responses import send_object
from store.db import get_engine

bp = Blueprint("meta", __name__)


@bp.get("/openapi.json")
def openapi():
    return jsonify(openapi_document())


@bp.get("/healthz")
def healthz():
    with get_engine(settings().database_url).connect() as conn:
        conn.execute(text("select 1"))
    return jsonify({"status": "ok"})


@bp.get("/v1/models")
def models():
    return send_object(ModelList(data=[Model(id=name) for name in settings().models]))
