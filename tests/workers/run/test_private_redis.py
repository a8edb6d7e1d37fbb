"""`rlbus run`'s private redis-server needs a password the run generated; its workers and `rlbus inspect` have it."""

import re
import signal
import subprocess
import sys

import pytest
import redis

from tests.paths import REPO
from tests.run_redis import run_redis_url
from tests.workers.run.test_session_e2e import (
    processes_mentioning,
    start_run,
    stdout_of,
    summary,
    wait_exit,
    wait_step,
)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_the_private_redis_refuses_a_client_without_the_runs_password(tmp_path, tiny_model_dir):
    """Before, the private Redis of `rlbus run` answered anyone who reached its port."""
    out = tmp_path / "run"
    # Stopped by the test once it has looked: a run of a few steps ends (and its Redis with it) before the checks.
    proc = start_run(out, tiny_model_dir, "--run.max_steps", "100000", "--eval.env", "none")
    try:
        wait_step(proc, out, 1, timeout_s=180)
        resolved = (out / "config.resolved.toml").read_text()
        url = re.search(r'^url = "(.+)"$', resolved, flags=re.M).group(1)
        with redis.Redis.from_url(url) as stranger, pytest.raises(redis.AuthenticationError):
            stranger.ping()
        password_file = out / "redis" / "password"
        assert f'password_file = "{password_file.resolve()}"' in resolved
        assert password_file.stat().st_mode & 0o777 == 0o600
        assert (out / "redis" / "redis.conf").stat().st_mode & 0o777 == 0o600
        password = password_file.read_text().strip()
        assert len(password) >= 32 and password not in resolved and password not in stdout_of(out)
        assert not processes_mentioning(password), "the password is on a command line"
        with redis.Redis.from_url(run_redis_url(out)) as client:
            assert client.ping()
        inspect = subprocess.run([sys.executable, "-m", "workers.cli", "inspect", "@",
                                  str(out / "config.resolved.toml")],
                                 capture_output=True, text=True, cwd=REPO, timeout=60)
        assert inspect.returncode == 0 and "tasks:echo_chars" in inspect.stdout, inspect.stdout + inspect.stderr
        proc.send_signal(signal.SIGTERM)
        assert wait_exit(proc, out, 120) == 0, stdout_of(out)[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    s = summary(out)
    assert s["stopped_because"] == "signal" and s["steps_trained"] >= 1
