"""A real Prometheus (Debian's /usr/bin/prometheus) scrapes a live `rlbus run` and its inference server: every panel
of the Grafana dashboard and every alert of deploy/prometheus answers through Prometheus's HTTP API with the labels
the dashboard expects, and the no-progress alert fires on a stopped trainer (SIGSTOP) and clears when it resumes;
`rlbus inspect --latency` prints the per-hop breakdown of the live run."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml

from bus.keys import Keys
from bus.local_redis import free_port
from tests.paths import REPO
from tests.run_redis import run_redis_url
from tests.workers.run.test_session_e2e import role_pid, start_run, stdout_of, trained_step

PROMETHEUS = "/usr/bin/prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "rlbus.json"
RULES = REPO / "deploy" / "prometheus" / "rlbus-alerts.yml"
RUN = "default"

NO_PROGRESS_S = 4
"""The no-progress alert's threshold in this test (the shipped rule says 600 s)."""


def dashboard_targets() -> list[dict]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t for p in panels if p["type"] != "row" for t in p["targets"]]


def concrete(expr: str) -> str:
    """A dashboard expression as Grafana would send it for this run."""
    return expr.replace("$run", RUN).replace("$__rate_interval", "15s")


def fast_rules(path: Path) -> Path:
    """The shipped rules with the no-progress alert's threshold and `for` cut to seconds."""
    text = RULES.read_text()
    fast = text.replace("rlbus_last_trained_age_seconds > 600", f"rlbus_last_trained_age_seconds > {NO_PROGRESS_S}")
    fast = fast.replace("for: 2m\n", "for: 1s\n", 1)
    assert fast.count(f"> {NO_PROGRESS_S}") == 1 and "for: 1s" in fast
    path.write_text(fast)
    return path


class Prometheus:
    def __init__(self, folder: Path, targets: dict[str, str]):
        self.port = free_port()
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(fast_rules(folder / "rules.yml"))],
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                                     for job, target in targets.items()]}
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(folder / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())

    def query(self, expr: str) -> list[dict]:
        answer = self.get("/api/v1/query", query=expr)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def alerts(self, name: str) -> list[dict]:
        return [a for a in self.get("/api/v1/alerts")["data"]["alerts"] if a["labels"]["alertname"] == name]

    def wait(self, what: str, done, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if done():
                    return
            except OSError:
                pass
            time.sleep(0.5)
        pytest.fail(f"Prometheus never {what}; its log:\n{Path(self.log.name).read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory, tiny_model_dir):
    """A default run (long enough to outlast the tests) scraped every second by a real Prometheus."""
    assert shutil.which(PROMETHEUS) or Path(PROMETHEUS).exists(), "apt-get install prometheus"
    folder = tmp_path_factory.mktemp("prometheus")
    out = folder / "run"
    exporter_port, inference_port = free_port(), free_port()
    proc = start_run(out, tiny_model_dir, "--run.max_steps", "2000", "--eval.interval", "1000",
                     "--eval.env.0.num_examples", "8", "--exporter.port", str(exporter_port),
                     "--inference.port", str(inference_port), "--trainer.lease_ttl_s", "120")
    prometheus = Prometheus(folder, {"rlbus": f"127.0.0.1:{exporter_port}",
                                     "rlbus-inference": f"127.0.0.1:{inference_port}"})
    try:
        deadline = time.monotonic() + 90
        while trained_step(out) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, stdout_of(out)[-4000:]
            time.sleep(0.5)
        assert f"metrics: http://0.0.0.0:{exporter_port}/metrics" in stdout_of(out)
        yield proc, out, prometheus
    finally:
        prometheus.stop()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def dead_letter_one(out: Path) -> None:
    """A task entry no worker can decode: the rollout worker dead-letters it (reason ``decode``)."""
    client = redis.Redis.from_url(run_redis_url(out))
    try:
        client.xadd(Keys(RUN).tasks("echo_chars"), {"kind": "task", "v": "1", "data": b"\xc1 not msgpack"})
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_every_dashboard_panel_and_alert_answers_with_its_labels(scraped_run):
    proc, out, prometheus = scraped_run
    dead_letter_one(out)
    prometheus.wait("saw a dead letter and a trained step's latency", lambda: prometheus.query(
        f'rlbus_dead_letters_total{{run="{RUN}"}}') and prometheus.query(
        f'rlbus_hop_latency_seconds_count{{run="{RUN}", hop="training"}} > 2'), 60)
    time.sleep(16)  # a whole rate window of scrapes
    empty = []
    for target in dashboard_targets():
        series = prometheus.query(concrete(target["expr"]))
        if not series:
            empty.append(target["expr"])
        for label in re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]):
            assert all(label in s["metric"] for s in series), (target["expr"], label, series[:2])
    assert not empty, f"panels without data: {empty}"
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    for rule in rules:
        prometheus.query(rule["expr"])  # valid, and Prometheus evaluates it
        for name in set(re.findall(r"\brlbus_\w+", rule["expr"])):
            assert prometheus.query(f'{name}{{run="{RUN}"}}'), f"{rule['alert']}: no series {name}"
    hops = {s["metric"]["hop"] for s in prometheus.query(f'rlbus_hop_latency_seconds_count{{run="{RUN}"}} > 0')}
    assert hops == {"queued", "generating", "filtering", "packing", "training"}
    reasons = prometheus.query(f'rlbus_dead_letters_total{{run="{RUN}"}}')
    assert [(s["metric"]["stream"], s["metric"]["reason"]) for s in reasons] == [("tasks", "decode")]
    assert proc.poll() is None


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_no_progress_alert_fires_on_a_stopped_trainer_and_clears_when_it_resumes(scraped_run):
    proc, out, prometheus = scraped_run
    prometheus.wait("saw the run train", lambda: prometheus.query(f'rlbus_policy_trained_step{{run="{RUN}"}} > 3'),
                    60)
    trainer = role_pid(out, "trainer")
    stopped_at = time.monotonic()
    subprocess.run(["kill", "-STOP", str(trainer)], check=True)
    try:
        prometheus.wait("fired RlbusNoProgress", lambda: any(
            a["state"] == "firing" for a in prometheus.alerts("RlbusNoProgress")), 40)
        fired_after_s = time.monotonic() - stopped_at
    finally:
        subprocess.run(["kill", "-CONT", str(trainer)], check=True)
    assert fired_after_s >= NO_PROGRESS_S
    prometheus.wait("cleared RlbusNoProgress", lambda: not prometheus.alerts("RlbusNoProgress"), 40)
    assert proc.poll() is None


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_inspect_latency_prints_every_hop_of_the_live_run(scraped_run):
    proc, out, _ = scraped_run
    done = subprocess.run([sys.executable, "-m", "workers.cli", "inspect", "--run", RUN,
                           "--redis-url", run_redis_url(out), "--latency", "4"],
                          capture_output=True, text=True, cwd=REPO, timeout=40)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[2:]}
    assert set(rows) == {"queued", "generating", "filtering", "packing", "training"}, done.stdout
    assert all(int(cells[0]) > 0 and cells[1] != "-" for cells in rows.values()), done.stdout
    print(done.stdout)
