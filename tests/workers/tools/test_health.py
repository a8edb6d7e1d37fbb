"""``rlbus health``: a real worker's heartbeat, fresh while it runs, stale while it is stopped, gone once it exits."""

import os
import signal
import subprocess
import sys
import time

from tests.paths import REPO


def rlbus(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


def until(check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.3)


def test_probe_follows_a_real_filter_worker(redis_url, run_name, tiny_model_dir):
    run = ["@", str(REPO / "configs/default.toml"), "--redis.url", redis_url, "--run.name", run_name,
           "--model.path", str(tiny_model_dir), "--redis.heartbeat_s", "0.5"]
    probe = [*run, "--role", "filter", "--max-age-s", "3"]
    assert "no filter worker" in rlbus("health", *probe).stderr
    worker = subprocess.Popen([sys.executable, "-m", "workers.cli", "filter", *run], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert until(lambda: rlbus("health", *probe).returncode == 0, 60), "the filter never became healthy"
        assert rlbus("health", *probe[:-4], "--role", "rollout").returncode == 1  # no rollout worker here
        table = rlbus("health", *run).stdout
        assert f"filter-{os.uname().nodename}-{worker.pid}" in table

        worker.send_signal(signal.SIGSTOP)  # a wedged worker: its loop no longer runs
        stale = until(lambda: (r := rlbus("health", *probe)).returncode == 1 and r, 15)
        assert stale and "last heartbeat" in stale.stderr, stale
        worker.send_signal(signal.SIGCONT)
        assert until(lambda: rlbus("health", *probe).returncode == 0, 15)

        worker.terminate()  # a clean stop leaves the set at once
        assert worker.wait(30) == 0
        gone = rlbus("health", *probe)
        assert gone.returncode == 1 and "no filter worker" in gone.stderr
    finally:
        worker.kill()
        worker.wait()


def test_probe_fails_when_redis_is_unreachable():
    result = rlbus("health", "--redis.url", "redis://127.0.0.1:1/0", "--role", "rollout")
    assert result.returncode == 1 and "cannot read heartbeats" in result.stderr
