"""deploy/kubernetes/*.yaml validate against the Kubernetes OpenAPI schemas (kubernetes-validate, offline, strict:
unknown fields are errors), and the fleet manifest hangs together: the router finds the replicas by their labels
with the RBAC it needs, its arguments are ones `pagedserve route` and vllm-router accept, the headless Service
selects the replicas' gRPC port, and the replicas' settings are valid pagedserve settings."""
from __future__ import annotations

import pathlib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
K8S_VERSION = "1.31.0"  # native sidecars (sidecar.yaml) need >= 1.29


def _docs(name: str) -> list[dict]:
    return list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / name).read_text()))


def _one(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_the_kubernetes_schema(path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError naming the field


def test_schema_validation_catches_a_bad_field():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = _one(_docs("fleet.yaml"), "Deployment", "pagedserve")
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_router_discovers_the_replicas_with_rbac():
    docs = _docs("fleet.yaml")
    replicas = _one(docs, "Deployment", "pagedserve")
    router = _one(docs, "Deployment", "pagedserve-router")
    pod_labels = replicas["spec"]["template"]["metadata"]["labels"]
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["pagedserve", "route"]
    from pagedserve import cli
    from pagedserve.fleet import router as route

    args = cli.build_parser({}).parse_args(["route", *container["args"]])
    selector = dict(s.split("=", 1) for s in args.selector)
    assert selector and all(pod_labels.get(k) == v for k, v in selector.items())
    replica = replicas["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in replica["env"]}
    assert args.service_discovery_port == int(env["PAGEDSERVE_HTTP_PORT"])
    assert "--service-discovery" in route.router_argv(args)
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    binding = _one(docs, "RoleBinding", account)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = _one(docs, "Role", binding["roleRef"]["name"])
    assert {"get", "list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["pods"]
    cli.build_parser(env).parse_args(["serve"])  # every variable is a known, valid setting


def test_replicas_probe_grpc_health_and_grpc_clients_get_a_headless_service():
    docs = _docs("fleet.yaml")
    pod = _one(docs, "Deployment", "pagedserve")["spec"]["template"]
    replica = pod["spec"]["containers"][0]
    for probe, service in [("readinessProbe", "pagedserve.v1.InferenceService"),
                           ("startupProbe", "pagedserve.v1.InferenceService"), ("livenessProbe", "")]:
        assert replica[probe]["grpc"] == {"port": 50051, "service": service}, probe
    headless = _one(docs, "Service", "pagedserve-grpc")
    assert headless["spec"]["clusterIP"] == "None"
    assert all(pod["metadata"]["labels"][k] == v for k, v in headless["spec"]["selector"].items())
    assert headless["spec"]["ports"][0]["port"] == 50051
    router_service = _one(docs, "Service", "pagedserve-router")
    router_pod = _one(docs, "Deployment", "pagedserve-router")["spec"]["template"]
    assert all(router_pod["metadata"]["labels"][k] == v for k, v in router_service["spec"]["selector"].items())
    assert router_pod["spec"]["containers"][0]["readinessProbe"]


def test_headless_target_gets_round_robin():
    from pagedserve_client.targets import channel_target

    assert channel_target("dns:///pagedserve-grpc.default.svc.cluster.local:50051")[1] is True
