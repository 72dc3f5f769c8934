"""JSON schemas for the OpenAPI document, generated from the pydantic declarations: the API objects
(api.objects) as `components.schemas`, the query parameters and multipart forms (api.inputs) as
operation parameters and request bodies. One clean-up makes pydantic's output what OpenAPI tools read:
no titles, no `default: null` on fields that are simply absent, keys constrained by `propertyNames`."""

from __future__ import annotations

import functools

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from api.inputs import JSON_VALUE_SCHEMA, FileUpload, JobUpload
from api.objects import REQUEST_OBJECTS, RESPONSE_OBJECTS, PathId
from api.objects_uploads import UPLOAD_REQUESTS, UPLOAD_RESPONSES
from api.objects_webhooks import WEBHOOK_REQUESTS, WEBHOOK_RESPONSES

REF = "#/components/schemas/{model}"


class _ComponentSchema(GenerateJsonSchema):
    """pydantic's JSON schema without a title on every property (the property name says it)."""

    def field_title_should_be_set(self, schema) -> bool:
        return False


def clean(schema):
    """pydantic's schema as the document states it: `patternProperties` (pydantic's form of constrained
    dict keys, which lets other keys through) as `propertyNames` and `additionalProperties`, no
    `default: null` (an absent field, not a null one) and no titles."""
    if isinstance(schema, list):
        return [clean(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: clean(v) for k, v in schema.items() if k != "title" and not (k == "default" and v is None)}
    patterns = out.pop("patternProperties", None)
    if patterns:
        ((pattern, values),) = patterns.items()
        out["propertyNames"] = {**out.get("propertyNames", {}), "pattern": pattern}
        out["additionalProperties"] = values
    return out


@functools.cache
def component_schemas() -> dict:
    """Every API object's JSON schema by name (and the types they share), refs under #/components/schemas/."""
    responses = RESPONSE_OBJECTS + UPLOAD_RESPONSES + WEBHOOK_RESPONSES
    requests = REQUEST_OBJECTS + UPLOAD_REQUESTS + WEBHOOK_REQUESTS
    models = [(m, "serialization") for m in responses] + [(m, "validation") for m in requests]
    _, schemas = models_json_schema(models, ref_template=REF, schema_generator=_ComponentSchema)
    defs = schemas["$defs"]
    for model in (FileUpload, JobUpload):  # the types the forms use (JsonValue)
        defs.update(_model_schema(model).get("$defs", {}))
    defs = clean(defs)
    return {**{name: _nullable_as_type(schema, defs) for name, schema in defs.items()}, "JsonValue": JSON_VALUE_SCHEMA}


def _nullable_as_type(schema, defs: dict):
    """`anyOf: [X, {type: null}]` (pydantic's `X | None`) as X with "null" among its types (a `$ref` X
    inlined): the same values, and no value a fuzzer could mutate out of X into the other branch."""
    if isinstance(schema, list):
        return [_nullable_as_type(item, defs) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _nullable_as_type(v, defs) for k, v in schema.items()}
    branches = out.get("anyOf")
    if isinstance(branches, list) and len(branches) == 2 and {"type": "null"} in branches:
        (other,) = [b for b in branches if b != {"type": "null"}]
        if "$ref" in other:
            other = {**defs[other["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in other.items() if k != "$ref"}}
        if isinstance(other.get("type"), str):
            del out["anyOf"]
            out = {**other, **out, "type": [other["type"], "null"]}
    return out


def _model_schema(model: type[BaseModel]) -> dict:
    return model.model_json_schema(ref_template=REF, schema_generator=_ComponentSchema)


def _properties(model: type[BaseModel]) -> tuple[dict, list[str]]:
    schema = clean(_model_schema(model))
    return schema["properties"], schema.get("required", [])


def query_parameters(model: type[BaseModel]) -> list[dict]:
    """`model`'s fields as optional query parameters."""
    params = []
    for name, schema in _properties(model)[0].items():
        description = schema.pop("description", None)
        params.append(
            {"name": name, "in": "query", "schema": schema, **({"description": description} if description else {})}
        )
    return params


def multipart_body(declaration: type[BaseModel], closed: bool = False, **overrides: dict) -> dict:
    """`declaration` as a required multipart/form-data body; JSON-valued fields go as application/json parts
    (OpenAPI's default for objects). `overrides` replace whole property schemas; `closed`: no other field."""
    properties, required = _properties(declaration)
    properties.update(overrides)
    schema = {"type": "object", "required": required, "properties": properties}
    if closed:
        schema["additionalProperties"] = False
    return {"required": True, "content": {"multipart/form-data": {"schema": schema}}}


def path_id(name: str, description: str) -> dict:
    """A path parameter holding an object's id (api.objects.PathId)."""
    schema = clean(TypeAdapter(PathId).json_schema())
    return {"name": name, "in": "path", "required": True, "schema": schema, "description": description}
