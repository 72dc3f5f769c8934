"""The Grafana dashboard under deploy/ references only metrics (and labels) the API and a worker expose."""

from __future__ import annotations

import json
import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pagedbatch.client import Client
from tests.helpers import MODEL, REPO, chat_line, jsonl

DASHBOARD = REPO / "deploy" / "grafana" / "pagedbatch.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exposed(text: str) -> dict[str, set[str]]:
    """Series name a query can use -> the label names seen on it."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        labels = {label for sample in family.samples for label in sample.labels} - {"le"}
        for suffix in SUFFIXES.get(family.type, ("",)):
            names[family.name + suffix] = labels
    return names


def expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_dashboard_references_only_exposed_metrics(live_url, worker, tmp_path):
    client = Client(live_url, api_key=worker.api_key)  # a job first, so that every series has samples
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([chat_line("d-0", "hi")]))
    assert client.wait(client.submit(src, model=MODEL)["id"], timeout=120, poll_s=0.2)["status"] == "completed"
    with urllib.request.urlopen(f"{live_url}/metrics", timeout=10) as r:
        api_text = r.read().decode()
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=10) as r:
        worker_text = r.read().decode()
    available = {**exposed(api_text), **exposed(worker_text)}
    used = set()
    for expr in expressions():
        names = set(re.findall(r"\bpagedbatch_[a-z0-9_]+", expr))
        assert names, expr
        missing = names - set(available)
        assert not missing, f"{expr}: {sorted(missing)} exposed by neither the API nor a worker"
        grouped = {g.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for g in group.split(",")} - {"le"}
        for name in names:
            assert available[name], f"{name} has no samples"
            assert grouped <= available[name], f"{expr}: {name} has labels {sorted(available[name])}"
        used |= names
    families = {name for name in available if name.startswith("pagedbatch_")}
    assert len(used) >= 15 and used <= families
