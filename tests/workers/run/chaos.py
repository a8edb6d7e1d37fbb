"""The chaos test's faults beyond kill -9: a hung env call, an inference outage, a flood of bad requests, a corrupt
newest checkpoint (tests/workers/run/test_session_e2e.py::test_chaos_…), and the env it runs."""

import json
import os
import signal
import time
import tomllib
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from workers.envs.base import Environment
from workers.envs.echo_chars import load_environment

BAD_REQUESTS = [{"logprobs": 10**6}, {"top_k": -7}, {"seed": 2**70}, {"temperature": -1.0}]
"""Sampling parameters out of range, each a 400 of the built-in server (they used to crash its engine)."""


def echo_chars_that_hangs_once(flag: str, **args) -> Environment:
    """``echo_chars`` whose next ``score`` never returns once the file ``flag`` exists (the first call to find it
    removes it): a hung env call, which the env server bounds and its owner replaces."""
    env = load_environment(**args)
    score = env.score

    def hanging_score(index, messages, state):
        try:
            os.unlink(flag)
        except FileNotFoundError:
            return score(index, messages, state)
        time.sleep(3600)

    env.score = hanging_score
    return env


def wait_log(out: Path, name: str, event: str, timeout_s: float) -> None:
    """Wait until ``out/logs/{name}.log`` mentions ``event``."""
    deadline = time.monotonic() + timeout_s
    while event not in (out / "logs" / f"{name}.log").read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {event} in logs/{name}.log after {timeout_s}s")
        time.sleep(0.2)


def hang_an_env_call(out: Path, flag: Path) -> None:
    """The next env score hangs: bounded (``env_call_hung``) and its server replaced (``env_server_restarted``)."""
    flag.touch()
    for event in ("env_call_hung", "env_server_restarted"):
        deadline = time.monotonic() + 180  # the inference server may be restarting: no env call before it is back
        while not any(event in log.read_text(errors="replace") for log in (out / "logs").glob("rollout-*.log")):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {event} in the rollout workers' logs within 180 s of the hang")
            time.sleep(0.2)


def flood_bad_requests(out: Path, count: int = 200) -> list[int]:
    """``count`` completions with out-of-range sampling parameters to the run's inference server; their statuses."""
    base = tomllib.loads((out / "config.resolved.toml").read_text())["inference"]["base_urls"][0]
    deadline = time.monotonic() + 120
    while True:  # up (a kill -9 just before may have it restarting)
        try:
            urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"the inference server at {base} did not answer /health within 120 s") from None
            time.sleep(0.5)

    def post(i: int) -> int:
        body = json.dumps({"prompt": [65, 66], "max_tokens": 4, **BAD_REQUESTS[i % len(BAD_REQUESTS)]}).encode()
        request = urllib.request.Request(f"{base}/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status
        except urllib.error.HTTPError as e:
            return e.code

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(post, range(count)))


def stop_for(pid: int, seconds: float) -> None:
    """SIGSTOP ``pid`` for ``seconds`` (a server that answers nothing, not even its heartbeat), then SIGCONT."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def corrupt_newest_checkpoint_and_kill(out: Path, trainer_pid) -> int:
    """Stop the trainer (``trainer_pid()``: its pid, None while it restarts), truncate its newest checkpoint's
    trainer.pt, kill -9 it; the step of that checkpoint."""
    deadline = time.monotonic() + 120
    while (pid := trainer_pid()) is None:
        if time.monotonic() > deadline:
            raise AssertionError("no trainer process within 120 s")
        time.sleep(0.5)
    os.kill(pid, signal.SIGSTOP)  # no newer checkpoint appears meanwhile
    steps = [int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*")
             if (p / "trainer.pt").exists()]
    newest = out / "checkpoints" / f"step_{max(steps)}" / "trainer.pt"
    with open(newest, "r+b") as f:
        f.truncate(newest.stat().st_size // 2)
    os.kill(pid, signal.SIGKILL)
    return max(steps)


def parent_of(pid: int) -> int:
    """The parent process of ``pid`` (a forked worker's: the run's fork server)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
