"""Helpers for the Kubernetes manifests' tests: render an overlay with `kubectl kustomize`, find objects,
resolve a container's environment as the kubelet would, and the schemas of the custom resources we use
(KEDA's and the Prometheus Operator's CRDs are not in kubernetes-validate; these schemas are ours, written
from their documentation, strict about the fields we set, so a misspelt field fails)."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO

K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("production", "dev")
REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    """kubectl's path; a test that needs it fails (never skips) where it is missing."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl is not installed: the Kubernetes manifests cannot be rendered (kustomize is built into "
            "kubectl). Install it (.ci/run does: Debian's kubernetes-client package) and run again."
        )
    return path


def render(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` renders (offline: no cluster, no network)."""
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def find(objects: list[dict], kind: str, name: str | None = None, component: str | None = None) -> list[dict]:
    return [
        o
        for o in objects
        if o["kind"] == kind
        and (name is None or o["metadata"]["name"] == name)
        and (component is None or o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component)
    ]


def one(objects: list[dict], kind: str, **kw) -> dict:
    found = find(objects, kind, **kw)
    assert len(found) == 1, f"expected one {kind} {kw}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict, name: str, init: bool = False) -> dict:
    (found,) = [c for c in pod_spec(workload)["initContainers" if init else "containers"] if c["name"] == name]
    return found


def env_sources(objects: list[dict], c: dict) -> dict[str, tuple]:
    """Each variable of container `c`: ("value", text) | ("secret", name, key) | ("configmap", name, key)."""
    sources: dict[str, tuple] = {}
    for source in c.get("envFrom", []):
        (cm,) = [one(objects, "ConfigMap", name=source["configMapRef"]["name"])]
        for key in cm.get("data", {}):
            sources[key] = ("configmap", cm["metadata"]["name"], key)
    for var in c.get("env", []):
        if "value" in var:
            sources[var["name"]] = ("value", var["value"])
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            sources[var["name"]] = ("secret", ref["name"], ref["key"])
        else:
            ref = var["valueFrom"]["configMapKeyRef"]
            sources[var["name"]] = ("configmap", ref["name"], ref["key"])
    return sources


def resolve_env(objects: list[dict], c: dict, secrets: dict[tuple[str, str], str] | None = None) -> dict[str, str]:
    """Container `c`'s environment as the kubelet builds it: envFrom first, then env in order, $(VAR) expanded
    from what is defined before; Secrets from `secrets` (name, key) or the rendered Secret objects."""
    secrets = dict(secrets or {})
    for s in find(objects, "Secret"):
        for key, value in s.get("stringData", {}).items():
            secrets[(s["metadata"]["name"], key)] = value
        for key, value in s.get("data", {}).items():
            secrets[(s["metadata"]["name"], key)] = base64.b64decode(value).decode()
    env: dict[str, str] = {}
    for name, source in env_sources(objects, c).items():
        if source[0] == "value":
            env[name] = REF.sub(lambda m: env.get(m.group(1), m.group(0)), source[1])
        elif source[0] == "configmap":
            env[name] = one(objects, "ConfigMap", name=source[1])["data"][source[2]]
        else:
            env[name] = secrets[(source[1], source[2])]
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """A command's $(VAR) references expanded; every one of them must be defined."""
    out = []
    for arg in args:
        missing = [m for m in REF.findall(arg) if m not in env]
        assert not missing, f"{arg!r} refers to undefined variables {missing}"
        out.append(REF.sub(lambda m: env[m.group(1)], arg))
    return out


_OBJECT = {"type": "object"}
_NAME_REF = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}},
    "additionalProperties": False,
}


def _strict(properties: dict, required: list[str] = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def _resource(api_version: str, kind: str, spec: dict) -> dict:
    metadata = _strict(
        {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _OBJECT, "annotations": _OBJECT},
        ["name"],
    )
    return _strict(
        {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": metadata, "spec": spec},
        ["apiVersion", "kind", "metadata", "spec"],
    )


_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_HPA_POLICY = _strict(
    {
        "type": {"enum": ["Pods", "Percent"]},
        "value": {"type": "integer", "minimum": 1},
        "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800},
    },
    ["type", "value", "periodSeconds"],
)
_HPA_RULES = _strict(
    {
        "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": {"type": "array", "items": _HPA_POLICY},
    }
)
_REDIS_METADATA = _strict(
    {
        "listName": {"type": "string", "minLength": 1},
        "listLength": {"type": "string", "pattern": "^[0-9]+$"},
        "activationListLength": {"type": "string", "pattern": "^[0-9]+$"},
        "databaseIndex": {"type": "string", "pattern": "^[0-9]+$"},
        "enableTLS": {"enum": ["true", "false"]},
        "address": {"type": "string"},
        "addressFromEnv": {"type": "string"},
        "passwordFromEnv": {"type": "string"},
    },
    ["listName", "listLength"],
)

# keda.sh/v1alpha1 ScaledObject and TriggerAuthentication (https://keda.sh/docs/latest/reference/scaledobject-spec/,
# .../concepts/authentication/, .../scalers/redis-lists/), the fields this project uses
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): _resource(
        "keda.sh/v1alpha1",
        "ScaledObject",
        _strict(
            {
                "scaleTargetRef": _strict(
                    {"name": {"type": "string"}, "kind": {"type": "string"}, "apiVersion": {"type": "string"}}, ["name"]
                ),
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "advanced": _strict(
                    {
                        "horizontalPodAutoscalerConfig": _strict(
                            {"behavior": _strict({"scaleDown": _HPA_RULES, "scaleUp": _HPA_RULES})}
                        )
                    }
                ),
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": _strict(
                        {
                            "type": {"const": "redis"},
                            "metadata": _REDIS_METADATA,
                            "authenticationRef": _NAME_REF,
                        },
                        ["type", "metadata"],
                    ),
                },
            },
            ["scaleTargetRef", "triggers"],
        ),
    ),
    ("keda.sh/v1alpha1", "TriggerAuthentication"): _resource(
        "keda.sh/v1alpha1",
        "TriggerAuthentication",
        _strict(
            {
                "secretTargetRef": {
                    "type": "array",
                    "minItems": 1,
                    "items": _strict(
                        {
                            "parameter": {
                                "enum": ["address", "host", "port", "username", "password", "tls", "ca", "cert", "key"]
                            },
                            "name": {"type": "string"},
                            "key": {"type": "string"},
                        },
                        ["parameter", "name", "key"],
                    ),
                },
            },
            ["secretTargetRef"],
        ),
    ),
    # monitoring.coreos.com/v1 (https://prometheus-operator.dev/docs/api-reference/api/)
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _resource(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        _strict(
            {
                "selector": _strict({"matchLabels": _STRING_MAP}, ["matchLabels"]),
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": _strict(
                        {"port": {"type": "string"}, "path": {"type": "string"}, "interval": {"type": "string"}},
                        ["port"],
                    ),
                },
            },
            ["selector", "endpoints"],
        ),
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): _resource(
        "monitoring.coreos.com/v1",
        "PodMonitor",
        _strict(
            {
                "selector": _strict({"matchLabels": _STRING_MAP}, ["matchLabels"]),
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": _strict(
                        {"port": {"type": "string"}, "path": {"type": "string"}, "interval": {"type": "string"}},
                        ["port"],
                    ),
                },
            },
            ["selector", "podMetricsEndpoints"],
        ),
    ),
}
