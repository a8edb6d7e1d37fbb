"""A CPU run on a real Slurm cluster (tests/slurm_cluster.py: slurmctld and three slurmd, each node a network
namespace), submitted with ``rlbus slurm``: the roles run as job steps on two nodes; a rollout job joins mid-run;
``scancel`` of the run stops every worker, and ``rlbus slurm --resume`` continues it; then a node of the run's job
is lost (its slurmd and every process on it killed -9), Slurm requeues the job on the nodes left, and the run
resumes from Redis's AOF and its checkpoints to max_steps with balanced books and no sample trained twice."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.local_redis import LocalRedis
from tests.paths import REPO
from tests.slurm_cluster import SlurmCluster, slurm_missing
from tests.workers.run.test_session_e2e import DEFAULT, assert_counts_add_up

MAX_STEPS = 60
RUN = "slurm-e2e"


def layer(out: Path, model_dir: Path) -> str:
    return f"""
[run]
name = "{RUN}"
output_dir = "{out}"
max_steps = {MAX_STEPS}

[redis]
claim_idle_ms = 3000
heartbeat_s = 1.0
reconnect_timeout_s = 10

[model]
path = "{model_dir}"

[rollout]
workers = 2
max_concurrent_groups = 4
tasks_per_minute = 120   # 2 groups/s a worker: a step (4 groups) every second or so, slow enough to act mid-run

[packer]
batch_size = 32

[trainer]
keep_batches = 0   # keep every step's batches, for the audit


[ckpt]
interval = 2

[slurm]
nodes = 2
exclusive = false
launcher = "{sys.executable} -m workers.cli"
stop_grace_s = 10
"""


class SlurmRun:
    def __init__(self, cluster: SlurmCluster, tmp_path: Path, model_dir: Path):
        self.cluster = cluster
        self.out = tmp_path / "run"
        self.config = tmp_path / "slurm.toml"
        self.config.write_text(layer(self.out, model_dir))

    def rlbus_slurm(self, *options: str) -> str:
        """``rlbus slurm`` on the controller host; the job id it submitted."""
        done = self.cluster.run(sys.executable, "-m", "workers.cli", "slurm", "@", str(DEFAULT), "@",
                                str(self.config), "--eval.env", "[]", *options, cwd=REPO, timeout_s=60)
        return done.stdout.strip().splitlines()[-1]

    def text(self, name: str) -> str:
        path = self.out / "slurm" / "logs" / name
        return path.read_text(errors="replace") if path.exists() else ""

    def step(self) -> int:
        steps = re.findall(r"^step (\d+)/", self.text("run.log"), flags=re.M)
        return int(steps[-1]) if steps else 0

    def wait(self, done, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                logs = "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                                 for p in sorted((self.out / "slurm").rglob("*.*")) if p.suffix in (".log", ".out"))
                pytest.fail(f"never {what} in {timeout_s}s; squeue:\n{self.squeue()}\nlogs:\n{logs}\n"
                            f"{self.cluster.logs()}")
            time.sleep(0.5)

    def squeue(self, *options: str) -> str:
        return self.cluster.run("squeue", "-h", *options, check=False).stdout

    def step_nodes(self, job: str) -> dict[str, str]:
        """Job step name → node, of the job's running steps."""
        listed = self.squeue("-s", "-j", job, "-o", "%j %N").split("\n")
        return dict(line.split() for line in listed if len(line.split()) == 2)

    def job_state(self, job: str) -> str:
        return self.squeue("-j", job, "-o", "%T").strip()


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_run_on_slurm_scales_stops_resumes_and_survives_a_lost_node(tmp_path, tiny_model_dir):
    if (reason := slurm_missing()) is not None:
        pytest.skip(reason)
    started = time.monotonic()

    def mark(what: str) -> None:
        print(f"{time.monotonic() - started:6.1f}s {what}", flush=True)

    cluster = SlurmCluster(tmp_path / "cluster", nodes=3).start()
    try:
        run = SlurmRun(cluster, tmp_path, tiny_model_dir)
        job = run.rlbus_slurm()
        mark(f"run job {job} submitted")
        run.wait(lambda: run.step() >= 2, "reached step 2", 150)
        nodes = run.step_nodes(job)
        assert len({nodes[name] for name in ("trainer", "rollout-0", "rollout-1")}) == 2, nodes

        mark(f"step {run.step()}: roles on {nodes}")
        more = run.rlbus_slurm("--role", "rollout", "--count", "1")
        run.wait(lambda: any("group_done" in p.read_text() for p in (run.out / "slurm" / "logs").glob("rollout-j*")),
                 "the added rollout worker finished a group", 90)

        mark(f"step {run.step()}: the added rollout worker took tasks")
        cluster.run("scancel", "--signal=TERM", job)  # the whole run: every worker gets SIGTERM and drains
        run.wait(lambda: not run.job_state(job), "the cancelled run job left the queue", 60)
        stopped_at = run.step()
        ended = (run.out / "slurm" / f"rlbus-{RUN}-{job}.out").read_text()
        assert "rlbus: run ended" in ended and "Killed" not in ended, ended  # nothing needed SIGKILL
        for log, event in (("trainer.log", "trainer_stopped"), ("rollout-0.log", "rollout_stopped"),
                           ("feeder.log", "feeder_stopped"), ("run.log", "(signal)")):
            assert event in run.text(log), f"{log} has no {event}"

        mark(f"step {stopped_at}: the cancelled run left the queue")
        job = run.rlbus_slurm("--resume")
        run.wait(lambda: run.step() >= stopped_at + 2, f"resumed past step {stopped_at + 2}", 150)
        assert run.step() < MAX_STEPS - 5, "the run went too fast to lose a node mid-run; raise MAX_STEPS"
        cluster.run("scancel", "--signal=TERM", more)  # the added rollout worker leaves again
        run.wait(lambda: not run.job_state(more), "the rollout job left the queue", 60)
        first, lost = cluster.hostnames(run.squeue("-j", job, "-o", "%N").strip())
        mark(f"step {run.step()}: resumed as job {job}; losing {lost}")
        cluster.lose(lost)  # the node with a rollout worker: slurmd and every process on it killed -9
        # Slurm holds a requeued job for 120 s (its BeginTime); an operator (this test) lets it start now.
        run.wait(lambda: run.job_state(job) == "PENDING", "the run job requeued after its node was lost", 90)
        mark(f"step {run.step()}: requeued; Slurm holds it {run.squeue('-j', job, '-o', '%r %S').strip()}")
        cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        run.wait(lambda: "restart 1" in "".join(p.read_text() for p in (run.out / "slurm").glob("rlbus-*.out")),
                 "the requeued run job started", 60)
        mark(f"step {run.step()}: the requeued run job started")
        run.wait(lambda: not run.job_state(job), "the run job ended by itself at max_steps", 150)
        mark(f"step {run.step()}: finished")
        summary = json.loads((run.out / "summary.json").read_text())
        assert summary["steps_trained"] == MAX_STEPS and summary["stopped_because"] == "max_steps", summary
        assert_counts_add_up(summary["groups"])
        # The job stopped its Redis; the run's AOF in run.output_dir/redis holds every step's batches.
        password = (run.out / "slurm" / "redis.password").read_text()
        store = LocalRedis(dir=run.out / "redis", password=password)
        url = store.start()
        try:
            audit = subprocess.run([sys.executable, "-m", "workers.cli", "inspect", "--run", RUN, "--audit", "--json",
                                    "--redis-url", url.replace("redis://", f"redis://:{password}@")],
                                   capture_output=True, text=True, cwd=REPO, timeout=60)
        finally:
            store.stop()
        assert audit.returncode == 0, audit.stdout + audit.stderr
        audited = json.loads(audit.stdout)
        assert audited["steps"] == MAX_STEPS and audited["trained_twice"] == [], audited["trained_twice"]
    finally:
        cluster.stop()
