"""A Redis primary, one replica and three sentinels on loopback, for failover tests (Debian's redis-server and
redis-sentinel; every process in a temp dir, on free ports)."""

import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from bus.local_redis import free_port, redis_binary, redis_server_argv

PRIMARY_NAME = "rlbus"


class SentinelCluster:
    def __init__(self, dir: Path):
        self.dir = dir
        self.ports = {"a": free_port(), "b": free_port()}
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{PRIMARY_NAME}/0"

    def _server(self, name: str, *extra: str) -> None:
        folder = self.dir / name
        folder.mkdir(parents=True, exist_ok=True)
        argv = [*redis_server_argv(redis_binary(), self.ports[name], folder, aof=False), "--logfile",
                str(folder / "redis.log"), *extra]
        self.procs[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: _answers(self.ports[name]), f"redis-server {name} on {self.ports[name]}")

    def start(self) -> "SentinelCluster":
        self._server("a")
        self._server("b", "--replicaof", "127.0.0.1", str(self.ports["a"]))
        wait_for(lambda: self.client("b").info("replication").get("master_link_status") == "up", "replica in sync")
        for i, port in enumerate(self.sentinel_ports):
            (self.dir / f"sentinel{i}.conf").write_text(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.dir}\n"
                f"logfile {self.dir / f'sentinel{i}.log'}\n"
                f"sentinel monitor {PRIMARY_NAME} 127.0.0.1 {self.ports['a']} 2\n"
                f"sentinel down-after-milliseconds {PRIMARY_NAME} 1000\n"
                f"sentinel failover-timeout {PRIMARY_NAME} 5000\n")
            self.start_sentinel(i, wait=False)
        for port in self.sentinel_ports:  # every sentinel knows the replica and the other sentinels
            wait_for(lambda p=port: _sentinel_sees(p), f"sentinel on {port} sees the replica and its peers", 30)
        return self

    def start_sentinel(self, i: int, wait: bool = True) -> None:
        """Start sentinel ``i`` from its config (which it rewrote with what it learnt); ``wait``: until it answers."""
        binary = shutil.which("redis-sentinel")
        assert binary, "redis-sentinel is not installed: apt-get install -y redis-sentinel"
        self.procs[f"sentinel{i}"] = subprocess.Popen([binary, str(self.dir / f"sentinel{i}.conf")],
                                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if wait:
            wait_for(lambda: _answers(self.sentinel_ports[i]), f"sentinel on {self.sentinel_ports[i]}")

    def client(self, name: str) -> redis.Redis:
        return redis.Redis(port=self.ports[name], socket_timeout=2)

    def primary(self) -> str:
        """Which server the first sentinel says is the primary now ("a" or "b")."""
        return self.primaries()[0]

    def primaries(self) -> list[str]:
        """Which server each sentinel says is the primary now."""
        names = []
        for sentinel_port in self.sentinel_ports:
            with redis.Redis(port=sentinel_port, decode_responses=True) as s:
                _, port = s.sentinel_get_master_addr_by_name(PRIMARY_NAME)
            names.append(next(name for name, p in self.ports.items() if p == int(port)))
        return names

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def fail_over(self, timeout_s: float = 30) -> str:
        """Kill the primary -9, wait until every sentinel names the promoted replica, then start the old primary
        again (empty), which they turn into the new primary's replica; returns the new primary's name. (Back too
        soon, the empty old primary takes the writes of a client that asked a sentinel just before the switch: a
        lost run, which the trainer's state check catches, but not a failover.)"""
        old = self.primary()
        self.kill(old)
        wait_for(lambda: len(set(self.primaries()) - {old}) == 1 and old not in self.primaries(),
                 "every sentinel to name the promoted replica", timeout_s)
        new = self.primary()
        time.sleep(3)  # a client that asked a sentinel just before the switch may still be connecting to the old one
        self._server(old)
        wait_for(lambda: self.client(old).info("replication").get("master_link_status") == "up",
                 "the old primary to rejoin as a replica", timeout_s)
        return new

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _answers(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_connect_timeout=0.3) as c:
            return bool(c.ping())
    except redis.RedisError:
        return False


def _sentinel_sees(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_connect_timeout=0.3, decode_responses=True) as s:
            return bool(s.sentinel_slaves(PRIMARY_NAME)) and len(s.sentinel_sentinels(PRIMARY_NAME)) >= 2
    except redis.RedisError:
        return False


def wait_for(check, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)
