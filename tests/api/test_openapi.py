"""The OpenAPI document covers exactly the app's routes and methods."""

import re


def test_openapi_matches_routes(client):
    spec = client.get("/openapi.json").get_json()
    assert spec["openapi"].startswith("3.")
    documented = {(path, method.upper()) for path, ops in spec["paths"].items() for method in ops}
    app = client.application
    served = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static" or rule.rule.startswith("/ui"):  # the dashboard's HTML pages and forms
            continue
        path = re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule)
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            served.add((path, method))
    assert documented == served


def test_openapi_path_parameters_are_declared(client):
    spec = client.get("/openapi.json").get_json()
    for path, ops in spec["paths"].items():
        names = set(re.findall(r"{([^}]+)}", path))
        for op in ops.values():
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert declared == names, (path, declared, names)
            assert op["responses"], path


def test_openapi_refs_resolve(client):
    spec = client.get("/openapi.json").get_json()
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', str(spec).replace("'", '"')))
    assert refs and refs <= set(spec["components"]["schemas"])
