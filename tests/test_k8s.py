"""deploy/k8s validates offline: every core object against the Kubernetes schemas (kubernetes-validate, strict),
the KEDA objects against KEDA's documented fields, and the workers run the same image and command lines as
docker-compose.yml, with liveness probes on their own heartbeats."""

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from bus.keys import GROUP_FILTER, GROUP_ROLLOUT, Keys
from tests.paths import REPO
from workers.config_loader import load_config

K8S = REPO / "deploy" / "k8s"
OVERLAYS = ["cpu", "gpu"]
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}
WORKER_ROLES = {"feeder", "packer", "rollout", "filter", "trainer", "inference"}

REDIS_STREAMS_METADATA = {
    "address", "addressFromEnv", "host", "hostFromEnv", "port", "portFromEnv", "usernameFromEnv", "passwordFromEnv",
    "stream", "consumerGroup", "pendingEntriesCount", "streamLength", "lagCount", "activationLagCount",
    "enableTLS", "unsafeSsl", "databaseIndex",
}
"""The redis-streams trigger's metadata fields (keda.sh/docs/2.15/scalers/redis-streams)."""

_NAME_REF = {"type": "object", "required": ["name"], "additionalProperties": False,
             "properties": {"name": {"type": "string"}, "kind": {"enum": ["TriggerAuthentication",
                                                                         "ClusterTriggerAuthentication"]}}}
_OBJECT_META = {"type": "object", "required": ["name"],
                "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                               "labels": {"type": "object", "additionalProperties": {"type": "string"}}}}
KEDA_SCHEMAS = {
    "ScaledObject": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"}, "metadata": _OBJECT_META,
            "spec": {
                "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
                "properties": {
                    "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                       "properties": {"name": {"type": "string"}, "kind": {"type": "string"},
                                                      "apiVersion": {"type": "string"},
                                                      "envSourceContainerName": {"type": "string"}}},
                    **{k: {"type": "integer", "minimum": 0} for k in
                       ("pollingInterval", "cooldownPeriod", "idleReplicaCount", "minReplicaCount",
                        "maxReplicaCount")},
                    "triggers": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                        "properties": {"type": {"type": "string"}, "name": {"type": "string"},
                                       "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                       "authenticationRef": _NAME_REF,
                                       "metadata": {"type": "object", "additionalProperties": {"type": "string"}}}}},
                },
            },
        },
    },
    "TriggerAuthentication": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "TriggerAuthentication"},
            "metadata": _OBJECT_META,
            "spec": {"type": "object", "additionalProperties": False, "properties": {
                "secretTargetRef": {"type": "array", "items": {
                    "type": "object", "required": ["parameter", "name", "key"], "additionalProperties": False,
                    "properties": {"parameter": {"type": "string"}, "name": {"type": "string"},
                                   "key": {"type": "string"}}}}}},
        },
    },
}
"""ScaledObject and TriggerAuthentication as KEDA documents them (keda.sh/docs/2.15/reference/scaledobject-spec,
concepts/authentication), restricted to the fields these manifests may use: an unknown field is refused."""


def overlay_files(folder: Path) -> list[Path]:
    """The files of a kustomization (resources only: these overlays use no patches or generators)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "namespace", "resources"}, "only resources are supported"
    files = []
    for entry in kustomization["resources"]:
        path = (folder / entry).resolve()
        files += overlay_files(path) if path.is_dir() else [path]
    return files


def objects(overlay: str) -> list[dict]:
    return [doc for f in overlay_files(K8S / overlay) for doc in yaml.safe_load_all(f.read_text()) if doc]


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def containers(overlay: str) -> dict[str, dict]:
    """Container name → container, over every workload of the overlay."""
    out = {}
    for obj in objects(overlay):
        if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
            for c in pod_spec(obj)["containers"]:
                assert c["name"] not in out, f"two containers named {c['name']}"
                out[c["name"]] = c
    return out


def compose_services() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_objects_validate_against_the_kubernetes_schemas(overlay):
    core = [obj for obj in objects(overlay) if obj["kind"] not in KEDA_KINDS]
    assert {obj["kind"] for obj in core} >= {"Namespace", "Service", "StatefulSet", "Deployment", "Job",
                                             "PersistentVolumeClaim", "NetworkPolicy"}
    for obj in core:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_objects_use_documented_fields_and_the_runs_own_streams(overlay):
    objs = objects(overlay)
    deployments = {o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"}
    auths = {o["metadata"]["name"] for o in objs if o["kind"] == "TriggerAuthentication"}
    redis_service = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "redis")
    config = load_config([REPO / "configs" / "default.toml"], [])
    keys = Keys(config.run.name)
    expected = {"rlbus-rollout": ({keys.tasks(e.resolved_name) for e in config.env}, GROUP_ROLLOUT),
                "rlbus-filter": ({keys.rollouts(e.resolved_name) for e in config.env}, GROUP_FILTER)}
    scaled = [o for o in objs if o["kind"] == "ScaledObject"]
    assert {o["metadata"]["name"] for o in scaled} == set(expected)
    for obj in objs:
        if obj["kind"] in KEDA_KINDS:
            jsonschema.validate(obj, KEDA_SCHEMAS[obj["kind"]])
    for obj in scaled:
        spec = obj["spec"]
        assert spec["scaleTargetRef"]["name"] in deployments
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        streams, group = expected[obj["metadata"]["name"]]
        assert {t["metadata"]["stream"] for t in spec["triggers"]} == streams  # one trigger per env
        for trigger in spec["triggers"]:
            meta = trigger["metadata"]
            assert trigger["type"] == "redis-streams" and set(meta) <= REDIS_STREAMS_METADATA, meta
            assert meta["consumerGroup"] == group and int(meta["lagCount"]) > 0 and "activationLagCount" in meta
            assert meta["address"].split(".")[0] == redis_service["metadata"]["name"]
            assert meta["address"].endswith(f":{redis_service['spec']['ports'][0]['port']}")
            assert trigger["authenticationRef"]["name"] in auths


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_run_the_compose_image_and_command_lines(overlay):
    services = compose_services()
    by_role = {"trainer": "trainer-gpu", "inference": "inference-vllm"} if overlay == "gpu" else {}
    found = containers(overlay)
    assert set(found) >= WORKER_ROLES | {"run", "redis"}
    for role in [*WORKER_ROLES, "run"]:
        service = services[by_role.get(role, role)]
        container = found[role]
        assert container["image"] == service["image"]
        assert container["command"] == service["entrypoint"] == ["sh", "-c"]
        assert container["args"] == [line.replace("$$", "$") for line in service["command"]], role


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_worker_probes_its_own_heartbeat_and_redis_keeps_its_data(overlay):
    objs = objects(overlay)
    found = containers(overlay)
    for role in WORKER_ROLES:
        probe = found[role]["livenessProbe"]["exec"]["command"]
        assert probe[:2] == ["sh", "-c"] and probe[2].startswith("exec rlbus health @ ")
        assert f"--role {role}" in probe[2]
        password = next(e for e in found[role]["env"] if e["name"] == "RLBUS_REDIS_PASSWORD")
        assert password["valueFrom"]["secretKeyRef"] == {"name": "rlbus-redis", "key": "password"}
    assert found["inference"]["readinessProbe"]["httpGet"]["path"] == "/health"
    redis_set = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "redis")
    args = found["redis"]["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and "--requirepass" in args
    assert redis_set["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] in {
        m["name"] for m in found["redis"]["volumeMounts"]}
    data = next(o for o in objs if o["kind"] == "PersistentVolumeClaim")
    assert data["spec"]["accessModes"] == ["ReadWriteMany"]  # trainer and servers on different nodes share it
    trainer = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "rlbus-trainer")
    limits = pod_spec(trainer)["containers"][0].get("resources", {}).get("limits", {})
    assert ("nvidia.com/gpu" in limits) == (overlay == "gpu")


def test_only_the_runs_pods_and_keda_reach_redis():
    policy = next(o for o in objects("cpu") if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "redis")
    sources = policy["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "rlbus"}}} in sources
    assert any(s.get("namespaceSelector", {}).get("matchLabels") == {"kubernetes.io/metadata.name": "keda"}
               for s in sources)
    labelled = [o for o in objects("cpu") if o["kind"] in ("Deployment", "StatefulSet", "Job")]
    for obj in labelled:
        assert obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rlbus"
