"""Simulated hosts for multi-host tests: one Linux network namespace per host, each with its own address on one
subnet, joined by veth pairs to a bridge that lives in a namespace of its own (needs root and ``ip netns``).

Nothing is added to the machine's own network: the bridge, the links and every address exist only inside the
namespaces this harness made, and :meth:`SimulatedHosts.stop` deletes them.

    hosts = SimulatedHosts(["store", "gpu"]).start()
    proc = hosts.popen("store", ["redis-server", "--bind", hosts.address("store")])
    hosts.lose("store")            # every process in it killed -9, its link cut
    hosts.stop()
"""

import os
import random
import shutil
import signal
import subprocess
import uuid
from pathlib import Path


def netns_available() -> str | None:
    """None when namespaces can be made here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "simulated hosts need root (ip netns)"
    if shutil.which("ip") is None:
        return "simulated hosts need iproute2 (ip)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class SimulatedHosts:
    def __init__(self, names: list[str]):
        tag = uuid.uuid4().hex[:6]
        self.names = names
        self.netns = {name: f"rlb{tag}-{name}" for name in names}
        self.switch = f"rlb{tag}-switch"
        self.links = {name: f"v{tag}{i}" for i, name in enumerate(names)}
        """The switch-side end of each host's link (interface names have at most 15 characters)."""
        self.subnet = f"10.{random.randrange(64, 250)}.{random.randrange(1, 250)}"
        self.procs: list[subprocess.Popen] = []
        self.made: list[str] = []
        """The namespaces this harness created (only these are cleaned up)."""

    def address(self, name: str) -> str:
        return f"{self.subnet}.{self.names.index(name) + 1}"

    def start(self) -> "SimulatedHosts":
        try:
            _ip("netns", "add", self.switch)
            self.made.append(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for name in self.names:
                ns, link = self.netns[name], self.links[name]
                _ip("netns", "add", ns)
                self.made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", self.switch, "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.switch, "link", "set", link, "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.stop()
            raise
        return self

    def popen(self, name: str, argv: list[str], log: Path, env: dict | None = None, cwd: Path | None = None
              ) -> subprocess.Popen:
        """Start ``argv`` on host ``name``, its output in ``log``."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.netns[name], *argv], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, cwd=cwd)
        self.procs.append(proc)
        return proc

    def pids(self, name: str) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", self.netns[name]], capture_output=True, text=True)
        return [int(pid) for pid in listed.stdout.split()]

    def lose(self, name: str) -> None:
        """The host is gone: every process in its namespace killed -9 and its link cut."""
        _ip("-n", self.switch, "link", "set", self.links[name], "down")
        for _ in range(3):  # a process may fork while we kill
            for pid in self.pids(name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        for name in self.names:
            if self.netns[name] not in self.made:
                continue
            for pid in self.pids(name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
