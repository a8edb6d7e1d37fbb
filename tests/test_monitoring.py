"""The monitoring files: the alert rules pass `promtool test rules` on synthetic series; the dashboard's queries name
the exporter's metrics; compose's `monitoring` profile and deploy/k8s/monitoring mount these very files (the
Kubernetes objects validate strictly). `python -m tests.test_monitoring` rewrites deploy/k8s/monitoring/config.yaml
from deploy/prometheus and deploy/grafana."""

import json
import re
import shutil
import subprocess

import kubernetes_validate
import yaml

from tests.paths import REPO

PROMETHEUS = REPO / "deploy" / "prometheus"
GRAFANA = REPO / "deploy" / "grafana"
K8S = REPO / "deploy" / "k8s" / "monitoring"
CONFIG_MAPS = {
    "rlbus-prometheus": [PROMETHEUS / "prometheus.yml", PROMETHEUS / "rlbus-alerts.yml"],
    "rlbus-grafana-datasources": [GRAFANA / "provisioning" / "datasources" / "prometheus.yml"],
    "rlbus-grafana-dashboard-providers": [GRAFANA / "provisioning" / "dashboards" / "rlbus.yml"],
    "rlbus-grafana-dashboards": [GRAFANA / "dashboards" / "rlbus.json"],
}
"""ConfigMap of deploy/k8s/monitoring/config.yaml → the files it holds."""


class _Literal(str):
    pass


yaml.SafeDumper.add_representer(_Literal, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|"))


def config_maps_text() -> str:
    docs = [{"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": name, "namespace": "rlbus", "labels": {"app.kubernetes.io/part-of": "rlbus"}},
             "data": {f.name: _Literal(f.read_text()) for f in files}} for name, files in CONFIG_MAPS.items()]
    head = "# Generated from deploy/prometheus and deploy/grafana by `python -m tests.test_monitoring`; do not edit.\n"
    return head + yaml.safe_dump_all(docs, sort_keys=False, width=200)


def promtool() -> str:
    binary = shutil.which("promtool")
    assert binary, "apt-get install prometheus (it ships promtool)"
    return binary


def test_alert_rules_pass_promtool_on_synthetic_series():
    check = subprocess.run([promtool(), "check", "rules", "rlbus-alerts.yml"], cwd=PROMETHEUS, capture_output=True,
                           text=True)
    assert check.returncode == 0 and "SUCCESS: 6 rules found" in check.stdout, check.stdout + check.stderr
    done = subprocess.run([promtool(), "test", "rules", "rlbus-alerts.test.yml"], cwd=PROMETHEUS,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", (PROMETHEUS / "rlbus-alerts.test.yml").read_text()))
    rules = yaml.safe_load((PROMETHEUS / "rlbus-alerts.yml").read_text())["groups"][0]["rules"]
    assert tested == {r["alert"] for r in rules}  # every alert has a case


def test_the_dashboard_queries_the_exporters_metrics_per_run():
    dashboard = json.loads((GRAFANA / "dashboards" / "rlbus.json").read_text())
    targets = [t for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]
    assert len(targets) >= 20
    for target in targets:
        assert re.search(r"\brlbus_\w+\{run=~\"\$run\"", target["expr"]), target["expr"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "run"}


def test_compose_monitoring_profile_mounts_the_deploy_files():
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    for name in ("exporter", "prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        for volume in services[name].get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), volume
    assert services["exporter"]["command"] == [
        "exec rlbus exporter @ $$RLBUS_CONFIG @ /app/configs/compose.toml --port 9400 $$RLBUS_ARGS"]
    scrape = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"]
    targets = {t for job in scrape for c in job["static_configs"] for t in c["targets"]}
    assert targets == {"exporter:9400", "inference:8000"}


def test_k8s_monitoring_validates_and_holds_the_deploy_files():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    objects = [doc for f in kustomization["resources"] for doc in yaml.safe_load_all((K8S / f).read_text()) if doc]
    for obj in objects:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    assert (K8S / "config.yaml").read_text() == config_maps_text(), "run `python -m tests.test_monitoring`"
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    assert services["exporter"]["spec"]["ports"][0]["port"] == 9400
    exporter = next(o for o in objects if o["metadata"]["name"] == "rlbus-exporter")
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["exporter"]
    container = exporter["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == [line.replace("$$", "$") for line in compose["command"]]
    maps = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        for volume in deployment["spec"]["template"]["spec"].get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps


if __name__ == "__main__":
    (K8S / "config.yaml").write_text(config_maps_text())
    print(f"wrote {K8S / 'config.yaml'}")
