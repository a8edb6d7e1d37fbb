"""The supervisor: restarts with backoff, process groups, children die with it."""

import os
import signal
import subprocess
import sys
import time

from tests.paths import REPO
from workers.run.supervisor import ChildSpec, Supervisor


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


def test_a_child_that_fails_on_its_config_is_not_restarted(tmp_path):
    events = []
    sup = Supervisor(tmp_path, on_event=lambda e, i: events.append((e, i)), backoff_initial_s=0.1)
    bad = "import sys; print('rlbus feeder: bad value'); sys.exit(2)"
    sup.start(ChildSpec("bad", "feeder", [sys.executable, "-c", bad]))
    assert _wait(lambda: (sup.poll(), sup.done("bad"))[1])
    time.sleep(0.3)
    sup.poll()
    assert sup.restarts_by_role()["feeder"] == 0
    assert [e for e, _ in events] == ["child_started", "child_exited"] and events[1][1]["exit_code"] == 2


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
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        child_pid = int(proc.stdout.readline())
        assert _alive(child_pid)
        proc.send_signal(signal.SIGKILL)
    assert _wait(lambda: not _alive(child_pid), 5), "child outlived its SIGKILLed supervisor"
