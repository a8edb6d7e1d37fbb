"""``rlbus run``'s fork server: workers forked from it are what their command lines would have started, their exits
reach the supervisor, and nothing outlives a killed server or supervisor."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO
from tests.workers.run.test_supervisor import _alive, _wait
from workers.forked import Forker, forkserver_argv
from workers.run.supervisor import ChildSpec, Supervisor

PROBE = "tests.workers.run.forked_probe"


def _reports(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")] if log.exists() else []


@pytest.fixture
def forking(tmp_path):
    """A supervisor with a fork server (preloading json) as its first child; its events."""
    events = []
    sup = Supervisor(tmp_path / "logs", on_event=lambda e, i: events.append((e, i)), backoff_initial_s=0.1)
    socket_path = str(tmp_path / "fork.sock")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = sup.start(ChildSpec("forkserver", "forkserver", forkserver_argv(socket_path, ["json"], None), env,
                                 stop_order=3))
    sup.forker = Forker(socket_path, server_alive=lambda: server.alive)
    yield sup, server, events
    sup.stop_all(grace_s=2)


def _probe(name: str, *args: str) -> ChildSpec:
    return ChildSpec(name, "probe", [sys.executable, "-m", PROBE, *args], {"PROBE_VAR": name, "PYTHONPATH": str(REPO)},
                     forkable=True)


def test_a_forked_worker_is_what_its_command_line_would_start(forking):
    sup, server, events = forking
    child = sup.start(_probe("probe", "3", "0.2"))
    log = sup.log_path("probe")
    assert _wait(lambda: _reports(log), 20), log.read_text() if log.exists() else "no log"
    report = _reports(log)[0]
    assert report["ppid"] == server.proc.pid, "not forked from the server"
    assert report["pid"] == report["pgid"] == child.proc.pid, "not in a process group of its own"
    assert report["cmdline"] == [sys.executable, "-m", PROBE, "3", "0.2"], "ps would not show the worker's command"
    assert report["argv"][1:] == ["3", "0.2"] and report["probe_var"] == "probe" and report["stdin"] == ""
    # Its exit code reaches the supervisor, which restarts it (forked again) with backoff.
    assert _wait(lambda: (sup.poll(), sup.children["probe"].restarts >= 1)[1])
    assert ("child_restarting", {"name": "probe", "exit_code": 3, "log": str(log), "in_s": 0.1, "restart": 1}) in events
    assert _wait(lambda: len(_reports(log)) >= 2) and _reports(log)[1]["ppid"] == server.proc.pid
    assert not [e for e, _ in events if e == "fork_unavailable"]


def test_stop_takes_a_forked_workers_group_and_a_config_exit_is_final(forking):
    sup, _, events = forking
    sup.start(_probe("bad", "2"))
    sleeper = sup.start(_probe("sleeper", "0", "60"))
    assert _wait(lambda: (sup.poll(), sup.done("bad"))[1])
    assert ("child_exited", {"name": "bad", "exit_code": 2, "log": str(sup.log_path("bad"))}) in events
    assert _wait(lambda: _reports(sup.log_path("sleeper")))
    grandchild = _reports(sup.log_path("sleeper"))[0]["grandchild"]
    sup.stop_all(grace_s=2)
    assert sleeper.proc.returncode == -signal.SIGTERM
    assert not _alive(sleeper.proc.pid) and _wait(lambda: not _alive(grandchild), 5)


def test_workers_of_a_killed_server_stop_and_come_back(forking):
    sup, server, events = forking
    sup.start(_probe("sleeper", "0", "60"))
    log = sup.log_path("sleeper")
    assert _wait(lambda: _reports(log))
    first = _reports(log)[0]["pid"]
    os.kill(server.proc.pid, signal.SIGKILL)
    # The worker gets its death signal; the supervisor restarts both (the worker exec'd when no server answers yet).
    assert _wait(lambda: not _alive(first), 10), "a worker outlived its fork server"
    assert _wait(lambda: (sup.poll(), len(_reports(log)) >= 2)[1], 20), events
    assert _alive(_reports(log)[1]["pid"])
    assert sup.children["forkserver"].restarts >= 1


def test_a_worker_s_own_forked_child_ends_with_it(forking, tmp_path):
    sup, server, _ = forking
    owner = sup.start(_probe("owner", "0", "60"))
    assert _wait(lambda: _reports(sup.log_path("owner")))
    # What a forked rollout worker does for its env server: ask the server that forked it, watching itself.
    log = tmp_path / "env.log"
    socket_path = str(tmp_path / "fork.sock")
    child = Forker(socket_path, server_alive=lambda: True).spawn(
        [sys.executable, "-m", PROBE, "0", "60"], {"PYTHONPATH": str(REPO)}, log, watch=owner.proc.pid)
    assert _wait(lambda: _reports(log))
    report = _reports(log)[0]
    assert report["ppid"] == server.proc.pid and report["pgid"] == owner.proc.pid, "not in its owner's group"
    os.kill(owner.proc.pid, signal.SIGKILL)
    assert child.wait(10) == -signal.SIGTERM, "a worker's forked child outlived it"
    # A child asked for on behalf of a process already gone ends at once (exit 1 once it was reaped).
    late = Forker(socket_path, server_alive=lambda: True).spawn(
        [sys.executable, "-m", PROBE, "0", "60"], {"PYTHONPATH": str(REPO)}, log, watch=owner.proc.pid)
    assert late.wait(10) in (1, -signal.SIGTERM)


def test_nothing_outlives_a_killed_supervisor(tmp_path):
    script = f"""
import json, os, sys, time
sys.path.insert(0, {str(REPO)!r})
from workers.forked import Forker, forkserver_argv
from workers.run.supervisor import ChildSpec, Supervisor
sup = Supervisor({str(tmp_path)!r})
server = sup.start(ChildSpec("forkserver", "f", forkserver_argv({str(tmp_path / 'fork.sock')!r}, [], None)))
sup.forker = Forker({str(tmp_path / 'fork.sock')!r}, server_alive=lambda: server.alive)
worker = sup.start(ChildSpec("w", "w", [sys.executable, "-m", {PROBE!r}, "0", "60"],
                             {{"PYTHONPATH": {str(REPO)!r}}}, forkable=True))
print(json.dumps([server.proc.pid, worker.proc.pid]), flush=True)
time.sleep(60)
"""
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        server_pid, worker_pid = json.loads(proc.stdout.readline())
        assert _wait(lambda: _reports(tmp_path / "w.log"), 20)
        proc.send_signal(signal.SIGKILL)
    for pid in (server_pid, worker_pid):  # (the probe's `sleep` has no death signal of its own, as under exec)
        assert _wait(lambda p=pid: not _alive(p), 10), f"pid {pid} outlived its SIGKILLed supervisor"


def test_a_request_it_cannot_fork_is_refused_and_exec_d_instead(forking):
    sup, _, events = forking
    child = sup.start(ChildSpec("plain", "p", [sys.executable, "-c", "print('plain')"], forkable=True))
    assert child.proc.wait(10) == 0 and "plain" in sup.log_path("plain").read_text()
    assert [i["name"] for e, i in events if e == "fork_unavailable"] == ["plain"]
