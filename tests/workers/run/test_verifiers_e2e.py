"""`rlbus run` on a verifiers v1 taskset (a package written in tests/, imported like an installed one), from a
prime-rl-style env block: spawned (its env server killed -9 mid-run) and at an external address."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bus.local_redis import free_port
from tests.paths import REPO
from tests.workers.run.test_session_e2e import (
    assert_counts_add_up,
    processes_mentioning,
    start_run,
    stdout_of,
    summary,
    wait_exit,
    wait_step,
)
from workers.env_config import EnvConfig

pytest.importorskip("verifiers.v1", reason="needs the verifiers extra: pip install 'rlbus[verifiers]'")

TASKSETS = REPO / "tests" / "workers" / "envs" / "vf_tasksets"

CONFIG = """
[run]
name = "vf"
seed = 0
[[env]]
taskset = {{ id = "rlbus-test-echo", num_tasks = 256 }}
group_size = 4
max_retries = 3
{address}
[sampling]
temperature = 1.0
max_completion_tokens = 4
[rollout]
max_concurrent_groups = 8
retry_delay_s = 0.2
[packer]
batch_size = 16
seq_len = 64
[trainer]
forward_batch = 8
lr = 5e-4
[eval]
interval = 2
[eval.sampling]
temperature = 0.0
max_completion_tokens = 4
[[eval.env]]
taskset = {{ id = "rlbus-test-echo", num_tasks = 8, seed = 1 }}
name = "echo_eval"
"""


@pytest.fixture(autouse=True)
def tasksets_installed(monkeypatch):
    monkeypatch.syspath_prepend(str(TASKSETS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TASKSETS), str(REPO), os.environ.get("PYTHONPATH", "")]))


def write_config(tmp_path: Path, address: str = "") -> Path:
    path = tmp_path / "vf.toml"
    path.write_text(CONFIG.format(address=f'address = "{address}"' if address else ""))
    return path


def check(out: Path, steps: int) -> dict:
    s = summary(out)
    assert s["steps_trained"] == steps and s["stopped_because"] == "max_steps", stdout_of(out)[-3000:]
    assert_counts_add_up(s["groups"])
    assert s["groups"]["trained"] > 0 and s["groups"]["dead_lettered"] == 0, s["groups"]
    assert "0" in s["eval"] and "eval/echo_eval/reward" in s["eval"]["0"], s["eval"]
    return s


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_spawned_verifiers_env_trains_and_survives_its_server_killed(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    proc = start_run(out, tiny_model_dir, "--run.max_steps", "4", config=write_config(tmp_path))
    try:
        wait_step(proc, out, 1, timeout_s=240)
        servers = processes_mentioning("workers.envs.verifiers_env")
        assert servers, "no verifiers env server was spawned"
        for pid in servers:
            os.kill(pid, signal.SIGKILL)
        assert wait_exit(proc, out, 170) == 0, stdout_of(out)[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    check(out, 4)
    assert not processes_mentioning(str(out)), "children outlived the run"
    assert not processes_mentioning("workers.envs.verifiers_env"), "a verifiers env server outlived the run"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_verifiers_env_at_an_external_address_trains(tmp_path, tiny_model_dir):
    address = f"tcp://127.0.0.1:{free_port()}"
    env = EnvConfig(taskset={"id": "rlbus-test-echo", "num_tasks": 256})
    from workers.envs.verifiers_env import vf_config_data

    server = subprocess.Popen([sys.executable, "-m", "workers.envs.verifiers_env", "--bind", address,
                               "--config", json.dumps(vf_config_data(env))], cwd=REPO)
    out = tmp_path / "run"
    try:
        proc = start_run(out, tiny_model_dir, "--run.max_steps", "2",
                         "--eval.env.0.address", address, config=write_config(tmp_path, address))
        assert wait_exit(proc, out, 380) == 0, stdout_of(out)[-4000:]
        check(out, 2)
        assert server.poll() is None, "the run must leave an external env server running"
    finally:
        server.terminate()
        server.wait(20)


def run_to_the_end(out: Path, model: Path, *overrides: str, config: Path) -> dict[int, float]:
    """A run of ``max_steps`` that trains every step and dead-letters nothing; its held-out greedy eval rewards."""
    proc = start_run(out, model, *overrides, config=config)
    try:
        assert wait_exit(proc, out, 300) == 0, stdout_of(out)[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    s = summary(out)
    assert s["stopped_because"] == "max_steps" and s["groups"]["dead_lettered"] == 0, s["groups"]
    return {int(k): v["eval/echo_eval/reward"] for k, v in s["eval"].items()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_on_a_tasksets_answers_makes_a_teacher_that_sft_and_opd_train_a_fresh_student_from(
        tmp_path, tiny_model_dir):
    config = write_config(tmp_path)
    sft = run_to_the_end(tmp_path / "reference", tiny_model_dir, "--run.max_steps", "40", "--eval.interval", "40",
                         "--env.0.mode", "sft", "--env.0.sft_source", "reference", "--env.0.group_size", "1",
                         "--trainer.lr", "3e-3", config=config)
    assert sft[0] < 0.2 and sft[40] > 0.8, sft  # greedy echo of held-out characters (random init ≈ 0.06)
    teacher = str(tmp_path / "reference" / "weights" / "step_40")
    student = run_to_the_end(tmp_path / "teacher", tiny_model_dir, "--run.max_steps", "40", "--eval.interval", "40",
                             "--env.0.mode", "sft", "--env.0.group_size", "1", "--teacher.path", teacher,
                             "--trainer.lr", "3e-3", config=config)
    assert student[0] < 0.2 and student[40] > 0.4, student  # the runs played on the teacher's server
    run_to_the_end(tmp_path / "opd", tiny_model_dir, "--run.max_steps", "4", "--eval.interval", "4",
                   "--env.0.mode", "opd", "--teacher.path", teacher, config=config)
    rows = [json.loads(line) for line in (tmp_path / "opd" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss/opd" in r]
    assert len(trained) == 4 and all(r["loss_tokens/opd"] > 0 and r["loss/opd"] > 0 for r in trained), trained
