"""The Kubernetes manifests (deploy/k8s, docs/deploy.md): every overlay renders with `kubectl kustomize`, every
object validates offline against the Kubernetes schemas (KEDA's and the Prometheus Operator's against ours),
and the wiring that matters holds: the workers' GPUs, KEDA's trigger on the very Redis list and server the
shards go to, the migration before the API, no credential outside a Secret, probes on real endpoints, a grace
period that covers the worker's drain. No cluster and no network: only kubectl's built-in kustomize."""

from __future__ import annotations

import copy
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
from kombu import Connection

from pagedbatch.cli import build_parser
from store.settings import Settings, parse_models
from tests import k8s_manifests as k8s
from tests.k8s_manifests import CRD_SCHEMAS, K8S, OVERLAYS, REF, container, env_sources, find, one, pod_spec

K8S_VERSIONS = ("1.29", "1.37")  # the oldest and newest Kubernetes the manifests are checked against
# what an operator puts in the production Secrets (created out of band, never rendered)
SECRETS = {
    ("pagedbatch-postgres", "url"): "postgresql://pb:pg-secret@db.example:5432/pagedbatch",
    ("pagedbatch-redis", "address"): "redis.example:6380",
    ("pagedbatch-redis", "password"): "redis-secret",
    ("pagedbatch-api", "secret-key"): "session-secret",
}
CREDENTIAL_NAMES = ("URL", "PASSWORD", "SECRET", "TOKEN", "KEY")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: k8s.render(K8S / "overlays" / name) for name in OVERLAYS}


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")]


def pagedbatch_containers(objects: list[dict]):
    """(workload, container) for every container (init ones too) that runs a `pagedbatch` command."""
    for w in workloads(objects):
        spec = pod_spec(w)
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c.get("command", [""])[0] == "pagedbatch":
                yield w, c


def parse(objects: list[dict], c: dict, monkeypatch):
    """The container's command as the real `pagedbatch` CLI parses it, in the container's environment."""
    env = k8s.resolve_env(objects, c, SECRETS)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return build_parser().parse_args(k8s.expand(c["command"][1:], env)), env


def workers(objects: list[dict]) -> list[dict]:
    found = find(objects, "Deployment", component="worker")
    assert found, "no worker Deployment"
    return found


@pytest.mark.parametrize("directory", ["base", "worker", "overlays/production", "overlays/dev"])
def test_each_kustomization_renders(directory):
    objects = k8s.render(K8S / directory)
    assert objects and all(o["apiVersion"] and o["kind"] and o["metadata"]["name"] for o in objects)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered, overlay):
    for obj in rendered[overlay]:
        schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if schema is not None:
            jsonschema.validate(obj, schema)
            continue
        for version in K8S_VERSIONS:  # strict: an unknown (misspelt) field is an error
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_validation_rejects_broken_objects(rendered):
    objects = rendered["production"]
    worker = copy.deepcopy(workers(objects)[0])
    pod_spec(worker)["terminationGracePeriod"] = 60  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, K8S_VERSIONS[-1], strict=True)
    worker = copy.deepcopy(workers(objects)[0])
    container(worker, "worker")["ports"][0]["containerPort"] = "ninety-one hundred"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, K8S_VERSIONS[-1], strict=True)
    scaled = copy.deepcopy(one(objects, "ScaledObject"))
    scaled["spec"]["triggers"][0]["metadata"]["listname"] = "pagedbatch.default"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, CRD_SCHEMAS[("keda.sh/v1alpha1", "ScaledObject")])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pagedbatch_command_parses_with_the_real_cli(rendered, overlay, monkeypatch):
    objects = rendered[overlay]
    commands = set()
    for _, c in pagedbatch_containers(objects):
        with monkeypatch.context() as m:
            args, env = parse(objects, c, m)
            commands.add(args.command)
            settings = Settings.from_env()
        if args.command in ("api", "worker"):
            assert settings.models == parse_models(env["PAGEDBATCH_MODELS"]) and settings.models
            url = Connection(settings.broker_url)  # the URL the pods build from the Redis Secret
            secret_address = k8s.resolve_env(objects, c, SECRETS)["PAGEDBATCH_REDIS_ADDRESS"]
            assert f"{url.hostname}:{url.port}" == secret_address
            assert url.password == k8s.resolve_env(objects, c, SECRETS)["PAGEDBATCH_REDIS_PASSWORD"]
            assert url.virtual_host == env["PAGEDBATCH_REDIS_DB"]
        if args.command == "worker":
            name, path = env["PAGEDBATCH_WORKER_MODEL"].split("=", 1)
            assert args.model == [f"{name}={path}"] and settings.models[name] == path  # the API knows the model
            assert args.drain_timeout == float(env["PAGEDBATCH_WORKER_DRAIN_S"]) > 0
    assert {"api", "worker", "migrate", "tiny-model" if overlay == "dev" else "migrate"} <= commands


def test_workers_request_their_tensor_parallel_size_in_gpus(rendered):
    worker_flags = build_parser()._subparsers._group_actions[0].choices["worker"]._option_string_actions
    for worker in workers(rendered["production"]):
        c = container(worker, "worker")
        tp = int(dict((v["name"], v.get("value")) for v in c["env"])["PAGEDBATCH_TENSOR_PARALLEL_SIZE"])
        assert tp >= 1
        assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == str(tp)
        if "--tensor-parallel-size" in worker_flags:  # once the worker takes it, the manifest must pass it on
            assert "--tensor-parallel-size=$(PAGEDBATCH_TENSOR_PARALLEL_SIZE)" in c["command"]
        assert "replicas" not in worker["spec"], "KEDA owns the worker count; a replicas field fights it"
    for obj in rendered["dev"]:
        assert "nvidia.com/gpu" not in str(obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers"))


def test_keda_scales_each_model_on_its_queue_in_the_workers_redis(rendered, monkeypatch):
    objects = rendered["production"]
    scaled_objects = find(objects, "ScaledObject")
    assert len(scaled_objects) == len(workers(objects))
    for scaled in scaled_objects:
        spec = scaled["spec"]
        worker = one(objects, "Deployment", name=spec["scaleTargetRef"]["name"])
        c = container(worker, "worker")
        with monkeypatch.context() as m:
            _, env = parse(objects, c, m)
            settings = Settings.from_env()
        model = env["PAGEDBATCH_WORKER_MODEL"].split("=", 1)[0]
        assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "redis"
        # kombu pushes a queue's messages onto the Redis list named by the queue, under the global key prefix
        assert trigger["metadata"]["listName"] == settings.broker_prefix + settings.queue_for(model)
        assert trigger["metadata"]["databaseIndex"] == env["PAGEDBATCH_REDIS_DB"]
        auth = one(objects, "TriggerAuthentication", name=trigger["authenticationRef"]["name"])
        params = {ref["parameter"]: ("secret", ref["name"], ref["key"]) for ref in auth["spec"]["secretTargetRef"]}
        sources = env_sources(objects, c)
        assert params == {
            "address": sources["PAGEDBATCH_REDIS_ADDRESS"],
            "password": sources["PAGEDBATCH_REDIS_PASSWORD"],
        }
        assert set(REF.findall(sources["PAGEDBATCH_BROKER_URL"][1])) >= {
            "PAGEDBATCH_REDIS_ADDRESS",
            "PAGEDBATCH_REDIS_PASSWORD",
        }


def test_the_list_keda_watches_is_the_list_a_shard_is_pushed_to(platform, rendered, monkeypatch):
    """The listName, checked against the wire: a shard enqueued the API's way lands on exactly that list."""
    import redis

    from broker.queue import enqueue_shards, purge_prefix

    objects = rendered["production"]
    scaled = one(objects, "ScaledObject")
    with monkeypatch.context() as m:
        _, env = parse(
            objects, container(one(objects, "Deployment", name=scaled["spec"]["scaleTargetRef"]["name"]), "worker"), m
        )
        deployed = Settings.from_env()
    model = env["PAGEDBATCH_WORKER_MODEL"].split("=", 1)[0]
    list_name = scaled["spec"]["triggers"][0]["metadata"]["listName"]
    # the deployment's settings on the test's Redis, under a test prefix that prefixes the list name alike
    prefix = (platform.settings.broker_prefix or "pagedbatch-test:") + "k8s:"
    settings = Settings(
        broker_url=platform.redis_url, broker_prefix=prefix + deployed.broker_prefix, queue_prefix=deployed.queue_prefix
    )
    client = redis.Redis.from_url(platform.redis_url)
    try:
        assert client.llen(prefix + list_name) == 0
        enqueue_shards(settings, [("batch_k8s.00000", model), ("batch_k8s.00001", model)])
        assert client.llen(prefix + list_name) == 2
    finally:
        purge_prefix(settings)
        client.close()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_schema_is_migrated_by_one_job_before_the_api_and_workers_start(rendered, overlay, monkeypatch):
    objects = rendered[overlay]
    job = one(objects, "Job", component="migrate")
    assert pod_spec(job)["restartPolicy"] == "OnFailure" and job["spec"]["backoffLimit"] >= 1
    (migrate,) = pod_spec(job)["containers"]
    args, _ = parse(objects, migrate, monkeypatch)
    assert args.command == "migrate" and args.wait is None  # the one container that migrates
    database = env_sources(objects, migrate)["PAGEDBATCH_DATABASE_URL"]
    assert database[0] == "secret"
    for workload in [one(objects, "Deployment", component="api"), *workers(objects)]:
        first_init = pod_spec(workload)["initContainers"][0]
        wait = [c for c in pod_spec(workload)["initContainers"] if c["name"] == "wait-for-schema"]
        assert wait, f"{workload['metadata']['name']} does not wait for the schema"
        with monkeypatch.context() as m:
            args, _ = parse(objects, wait[0], m)
        assert args.command == "migrate" and args.wait > 0
        assert env_sources(objects, wait[0])["PAGEDBATCH_DATABASE_URL"] == database
        main = pod_spec(workload)["containers"][0]
        assert env_sources(objects, main)["PAGEDBATCH_DATABASE_URL"] == database
        assert first_init["name"] in ("wait-for-schema", "tiny-model")
    others = [c for w, c in pagedbatch_containers(objects) if w is not job and c["command"][1] == "migrate"]
    assert all("--wait" in c["command"] for c in others), "a pod other than the Job migrates"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_credential_is_written_into_a_manifest(rendered, overlay):
    objects = rendered[overlay]
    if overlay == "production":
        assert not find(objects, "Secret"), "production's Secrets are created out of band, never rendered"
    for w in workloads(objects):
        for c in pod_spec(w).get("initContainers", []) + pod_spec(w)["containers"]:
            sources = env_sources(objects, c)
            for name, source in sources.items():
                if not any(word in name for word in CREDENTIAL_NAMES) or name == "PAGEDBATCH_REDIS_DB":
                    continue
                if source[0] == "value":  # only composed of references to Secrets, never a literal credential
                    refs = REF.findall(source[1])
                    assert refs and urlsplit(REF.sub("", source[1])).netloc in ("", ":@"), (name, source)
                    assert any(sources[r][0] == "secret" for r in refs), (name, source)
                elif source[0] == "configmap":  # a setting such as PAGEDBATCH_STORAGE_URL: no credential in it
                    value = one(objects, "ConfigMap", name=source[1])["data"][source[2]]
                    assert "@" not in value and urlsplit(value).password is None, (name, value)
    for cm in find(objects, "ConfigMap"):
        for key, value in cm.get("data", {}).items():
            assert "@" not in value and "password" not in value.lower(), (key, value)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_probes_ask_endpoints_the_api_serves_without_a_key(platform, rendered, overlay, monkeypatch):
    from api.app import create_app

    objects = rendered[overlay]
    api = one(objects, "Deployment", component="api")
    c = container(api, "api")
    args, _ = parse(objects, c, monkeypatch)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    client = create_app(platform.settings).test_client()  # no Authorization header, as the kubelet sends none
    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert ports[get["port"]] == args.port
        response = client.get(get["path"])
        assert response.status_code == 200, (probe, get["path"], response.get_data(as_text=True))
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"  # the one that asks the database
    service = one(objects, "Service", name="pagedbatch-api")
    assert service["spec"]["selector"].items() <= api["spec"]["template"]["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    for ingress in find(objects, "Ingress"):
        backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
        assert backend["name"] == "pagedbatch-api"
        assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grace_period_covers_the_workers_drain(rendered, overlay, monkeypatch):
    for worker in workers(rendered[overlay]):
        with monkeypatch.context() as m:
            args, _ = parse(rendered[overlay], container(worker, "worker"), m)
        grace = pod_spec(worker)["terminationGracePeriodSeconds"]
        assert args.drain_timeout > 0 and args.drain_timeout + 30 <= grace, (args.drain_timeout, grace)


def test_prometheus_scrapes_the_ports_that_serve_metrics(rendered, monkeypatch):
    objects = rendered["production"]
    for workload in [one(objects, "Deployment", component="api"), *workers(objects)]:
        template = workload["spec"]["template"]
        c = template["spec"]["containers"][0]
        with monkeypatch.context() as m:
            args, _ = parse(objects, c, m)
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        served = args.port if args.command == "api" else args.metrics_port
        assert int(annotations["prometheus.io/port"]) == served
        assert served in [p["containerPort"] for p in c["ports"]]
    service_monitor, pod_monitor = one(objects, "ServiceMonitor"), one(objects, "PodMonitor")
    service = one(objects, "Service", name="pagedbatch-api")
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service_monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    for worker in workers(objects):
        labels = worker["spec"]["template"]["metadata"]["labels"]
        assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        names = {p["name"]: p["containerPort"] for p in container(worker, "worker")["ports"]}
        assert names[pod_monitor["spec"]["podMetricsEndpoints"][0]["port"]] == 9100


def test_the_dev_overlay_runs_postgres_and_redis_in_the_cluster(rendered, monkeypatch):
    objects = rendered["dev"]
    assert not find(objects, "ScaledObject") and not find(objects, "TriggerAuthentication")
    secrets = k8s.resolve_env(
        objects,
        {
            "env": [
                {"name": n, "valueFrom": {"secretKeyRef": {"name": s, "key": k}}}
                for n, s, k in [
                    ("URL", "pagedbatch-postgres", "url"),
                    ("PG", "pagedbatch-postgres", "password"),
                    ("ADDRESS", "pagedbatch-redis", "address"),
                    ("REDIS", "pagedbatch-redis", "password"),
                ]
            ]
        },
    )
    url = urlsplit(secrets["URL"])
    postgres_service = one(objects, "Service", name=url.hostname)
    assert url.port in [p["port"] for p in postgres_service["spec"]["ports"]] and url.password == secrets["PG"]
    postgres = one(objects, "StatefulSet", name="postgres")
    assert postgres_service["spec"]["selector"].items() <= postgres["spec"]["template"]["metadata"]["labels"].items()
    assert env_sources(objects, container(postgres, "postgres"))["POSTGRES_PASSWORD"] == (
        "secret",
        "pagedbatch-postgres",
        "password",
    )
    host, port = secrets["ADDRESS"].split(":")
    redis_service = one(objects, "Service", name=host)
    assert int(port) in [p["port"] for p in redis_service["spec"]["ports"]]
    redis = one(objects, "Deployment", name="redis")
    server = container(redis, "redis")
    assert "--requirepass" in server["command"]
    assert env_sources(objects, server)["REDIS_PASSWORD"] == ("secret", "pagedbatch-redis", "password")
    assert k8s.expand(server["command"], k8s.resolve_env(objects, server))[-1] == secrets["REDIS"]
    for worker in workers(objects):
        args, env = parse(objects, container(worker, "worker"), monkeypatch)
        assert args.device == "cpu"
    for workload in [one(objects, "Deployment", component="api"), *workers(objects)]:
        (tiny,) = [c for c in pod_spec(workload)["initContainers"] if c["name"] == "tiny-model"]
        path = tiny["command"][-1]
        assert path in parse_models(env["PAGEDBATCH_MODELS"]).values()
        mounts = {m["name"]: m["mountPath"] for m in tiny["volumeMounts"]}
        main_mounts = {m["name"]: m["mountPath"] for m in pod_spec(workload)["containers"][0]["volumeMounts"]}
        assert mounts["models"] == main_mounts["models"] and path.startswith(mounts["models"] + "/")
