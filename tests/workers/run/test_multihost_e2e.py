"""A run across four simulated hosts (network namespaces, tests/hosts.py): Redis, feeder, packer and the watcher
(`rlbus run --attach`) on one; the trainer and an inference server on a second; a rollout and a filter worker on
each of the other two. Every worker is started by hand, the way an operator starts them on separate machines,
and reaches the others only over the namespaces' network (weights through the shared output folder). Mid-run one
rollout host is lost: every process on it killed -9, its link cut. The run still reaches max_steps, its books
balance, and no sample is trained twice. A second run puts the inference server on a host of its own and sends
it every update over the weight broadcast (gloo on CPU) instead of the shared folder."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hosts import SimulatedHosts, netns_available
from tests.paths import REPO
from tests.workers.run.test_session_e2e import DEFAULT, assert_counts_add_up

MAX_STEPS = 16
PASSWORD = "multihost-test-password"


def layer(hosts: SimulatedHosts, out: Path, model_dir: Path, inference_host: str) -> str:
    return f"""
[run]
name = "multihost"
output_dir = "{out}"
max_steps = {MAX_STEPS}

[redis]
url = "redis://{hosts.address('store')}:6379/0"
password_var = "RLBUS_REDIS_PASSWORD"
claim_idle_ms = 3000
heartbeat_s = 1.0

[model]
path = "{model_dir}"

[inference]
host = "0.0.0.0"
base_urls = ["http://{hosts.address(inference_host)}:8000/v1"]

[trainer]
keep_batches = 0   # keep every step's batches, for the audit

[eval]
interval = 8

[ckpt]
interval = 4
"""


class Cluster:
    """Redis on the ``store`` host and each role started by hand on the host named, all with one config layer."""

    def __init__(self, hosts: SimulatedHosts, tmp_path: Path, model_dir: Path, inference_host: str, *extra: str):
        self.hosts = hosts
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        self.out = tmp_path / "shared" / "run"  # the folder every host mounts (weights, checkpoints, metrics)
        self.config = tmp_path / "hosts.toml"
        self.config.write_text(layer(hosts, self.out, model_dir, inference_host))
        self.extra = extra
        self.env = {**os.environ, "RLBUS_REDIS_PASSWORD": PASSWORD}
        redis_dir = tmp_path / "redis"
        redis_dir.mkdir()
        hosts.popen("store", ["redis-server", "--bind", hosts.address("store"), "--port", "6379", "--save", "",
                              "--appendonly", "yes", "--dir", str(redis_dir), "--requirepass", PASSWORD],
                    self.logs / "store-redis.log")
        self.wait(lambda: "Ready to accept connections" in (self.logs / "store-redis.log").read_text(),
                  "redis ready", 30)

    def role(self, host: str, name: str, *extra: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "workers.cli", name, "@", str(DEFAULT), "@", str(self.config),
                "--eval.env.0.num_examples", "8", *self.extra, *extra]
        return self.hosts.popen(host, argv, self.logs / f"{host}-{name}.log", env=self.env, cwd=REPO)

    def on(self, host: str, *argv: str) -> subprocess.CompletedProcess:
        """Run ``rlbus ARGV`` on ``host`` and wait for it."""
        return subprocess.run(["ip", "netns", "exec", self.hosts.netns[host], sys.executable, "-m", "workers.cli",
                               *argv], capture_output=True, text=True, env=self.env, cwd=REPO, timeout=60)

    def log(self, host: str, role: str) -> str:
        return (self.logs / f"{host}-{role}.log").read_text()

    def wait(self, done, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                tails = "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.logs.glob("*.log")))
                pytest.fail(f"never {what} in {timeout_s}s; the hosts' logs:\n{tails}")
            time.sleep(0.5)

    def step(self) -> int:
        steps = re.findall(r"^step (\d+)/", self.log("store", "run"), flags=re.M)
        return int(steps[-1]) if steps else 0

    def finish(self, watcher: subprocess.Popen, max_steps: int) -> None:
        """The watcher exits 0 at max_steps with balanced books, and no sample was trained twice."""
        try:
            watcher.wait(200)
        except subprocess.TimeoutExpired:
            self.wait(lambda: False, "finished", 0)
        assert watcher.returncode == 0, self.log("store", "run")[-4000:]
        done = json.loads((self.out / "summary.json").read_text())
        assert done["steps_trained"] == max_steps and done["stopped_because"] == "max_steps", done
        assert_counts_add_up(done["groups"])
        audit = self.on("store", "inspect", "--run", "multihost", "--audit", "--json", "--redis-url",
                        f"redis://:{PASSWORD}@{self.hosts.address('store')}:6379/0")
        assert audit.returncode == 0, audit.stdout + audit.stderr
        assert json.loads(audit.stdout)["steps"] == max_steps


def hosts_or_skip(names: list[str]) -> SimulatedHosts:
    if (reason := netns_available()) is not None:
        pytest.skip(reason)
    return SimulatedHosts(names).start()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_run_across_hosts_survives_losing_one(tmp_path, tiny_model_dir):
    hosts = hosts_or_skip(["store", "gpu", "roll-a", "roll-b"])
    try:
        cluster = Cluster(hosts, tmp_path, tiny_model_dir, "gpu")
        watcher = cluster.role("store", "run", "--attach")
        cluster.role("store", "feeder")
        cluster.role("store", "packer")
        cluster.role("gpu", "trainer")
        cluster.role("gpu", "inference", "--port", "8000")
        for host in ("roll-a", "roll-b"):
            cluster.role(host, "rollout")
            cluster.role(host, "filter")
        cluster.wait(lambda: cluster.step() >= 5, "reached step 5", 240)
        probe = cluster.on("store", "health", "@", str(DEFAULT), "@", str(cluster.config), "--role", "rollout",
                           "--any-host")
        assert probe.returncode == 0, probe.stderr  # the rollout hosts heartbeat to the store host's Redis
        assert "group_done" in cluster.log("roll-b", "rollout")  # both rollout hosts took tasks
        hosts.lose("roll-b")
        cluster.finish(watcher, MAX_STEPS)
    finally:
        hosts.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_weights_cross_hosts_over_the_broadcast(tmp_path, tiny_model_dir):
    hosts = hosts_or_skip(["store", "gpu", "infer", "roll"])
    try:
        steps = 6
        cluster = Cluster(hosts, tmp_path, tiny_model_dir, "infer", "--run.max_steps", str(steps),
                          "--trainer.weight_transport", "nccl", "--trainer.nccl_host", hosts.address("gpu"),
                          "--trainer.inference_world_size", "1", "--eval.interval", "3")
        watcher = cluster.role("store", "run", "--attach")
        cluster.role("store", "feeder")
        cluster.role("store", "packer")
        cluster.role("gpu", "trainer")
        cluster.role("infer", "inference", "--port", "8000")
        cluster.role("roll", "rollout")
        cluster.role("roll", "filter")
        cluster.finish(watcher, steps)
        assert not (cluster.out / "weights").exists()  # nothing went through the shared folder
        assert re.search(r"weights_loaded .*format=nccl.* step=6", cluster.log("infer", "inference"))
    finally:
        hosts.stop()
